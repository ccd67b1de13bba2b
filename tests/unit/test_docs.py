"""The docs name the tree as it is: every file in its package's table, no stale path.

- Each package README (``indexer/``, ``router_client/``, ``tee/``, ``xfer/``,
  ``lab/``, ``kvmesh/``) has a file table naming every hand-written source
  file below it (generated stubs are named by their folder).
- Every repository path written in backticks in the README, SECURITY.md, the
  package READMEs and docs/ exists.
- Every test SECURITY.md cites as proof exists in the test file it names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PACKAGES = ("kvmesh", "indexer", "router_client", "tee", "xfer", "lab")

#: Files a package table need not list: package markers and generated stubs.
_UNLISTED = re.compile(r"(^|/)(__init__\.py|py\.typed)$|_pb2(_grpc)?\.pyi?$")

#: A backticked repository path: starts with a top-level folder of the tree.
_TOP = (
    "kvmesh/",
    "indexer/",
    "router_client/",
    "tee/",
    "xfer/",
    "lab/",
    "tests/",
    "tools/",
    "docs/",
    "helm/",
    "proto/",
    "clients/",
)
_BACKTICK = re.compile(r"`([^`\s]+)`")


def _listed_files(pkg: str) -> list[str]:
    base = ROOT / pkg
    out = []
    for path in sorted(base.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(base).as_posix()
        if _UNLISTED.search(rel) or rel == "README.md" or rel.startswith("data/"):
            continue
        if path.suffix in {".py", ".lua", ".md"}:
            out.append(rel)
    return out


def missing_from_table(readme: str, files: list[str]) -> list[str]:
    """Files of ``files`` that no table row of ``readme`` names.

    A row names a file by its path (``redis/keys.py``), or as a folder row
    (``redis/``) that also names the file's rest (``keys.py``); a folder row
    alone covers the non-Python files right inside it (``lua/``: the scripts).
    """
    rows = [set(_BACKTICK.findall(line)) for line in readme.splitlines() if line.startswith("|")]
    missing = []
    for rel in files:
        parts = rel.split("/")
        parent = "/".join(parts[:-1]) + "/" if len(parts) > 1 else ""
        ok = False
        for cells in rows:
            if rel in cells:
                ok = True
            for i in range(1, len(parts)):
                folder = "/".join(parts[:i]) + "/"
                rest = "/".join(parts[i:])
                if folder in cells and (
                    rest in cells or (folder == parent and not rel.endswith(".py"))
                ):
                    ok = True
        if not ok:
            missing.append(rel)
    return missing


@pytest.mark.parametrize("pkg", PACKAGES)
def test_package_readme_lists_every_file(pkg: str) -> None:
    readme = ROOT / pkg / "README.md"
    assert readme.exists(), f"{pkg}/README.md is missing"
    missing = missing_from_table(readme.read_text(), _listed_files(pkg))
    assert not missing, f"{pkg}/README.md has no table row for: {missing}"


def test_table_check_catches_an_unlisted_file() -> None:
    """The check itself: a file without a row is reported, one with a row or a folder row is not."""
    readme = (
        "| file | purpose |\n|---|---|\n| `a.py` | a |\n| `sub/` | `x.py` and `lua/` |\n"
        "| `sub/lua/` | scripts |\n"
    )
    files = ["a.py", "sub/x.py", "sub/y.py", "sub/lua/s.lua", "b.py"]
    assert missing_from_table(readme, files) == ["sub/y.py", "b.py"]


def _doc_files() -> list[Path]:
    docs = [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").rglob("*.md"))]
    docs += [ROOT / p / "README.md" for p in PACKAGES if (ROOT / p / "README.md").exists()]
    docs += [ROOT / "indexer" / "redis" / "KEYS.md", ROOT / "helm" / "README.md"]
    return docs


def stale_paths(text: str, base: Path, here: Path | None = None) -> list[str]:
    """Backticked repository paths in ``text`` that exist neither below ``base`` nor ``here``.

    ``here`` is the document's own folder: a package README may name its files
    relative to itself.
    """
    stale = []
    for token in _BACKTICK.findall(text):
        path = token.split("::")[0].rstrip(".,:;)")
        if not path.startswith(_TOP) or any(c in path for c in "*<>{}$"):
            continue
        if not (base / path).exists() and not (here is not None and (here / path).exists()):
            stale.append(path)
    return stale


@pytest.mark.parametrize("doc", _doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_name_no_stale_path(doc: Path) -> None:
    stale = stale_paths(doc.read_text(), ROOT, doc.parent)
    assert not stale, f"{doc.relative_to(ROOT)} names paths that do not exist: {stale}"


def test_stale_path_check_catches_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "indexer").mkdir()
    (tmp_path / "indexer" / "a.py").write_text("")
    text = "see `indexer/a.py`, `indexer/gone.py` and `tests/x.py::test_y`"
    assert stale_paths(text, tmp_path) == ["indexer/gone.py", "tests/x.py"]


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")
    }


def test_security_md_cites_tests_that_exist() -> None:
    """Each `test_…` SECURITY.md names exists in the test file named in the same table row."""
    text = (ROOT / "SECURITY.md").read_text()
    every = set()
    for f in (ROOT / "tests").rglob("test_*.py"):
        every |= _test_names(f)
    problems = []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        files = [
            ROOT / p.split("::")[0]
            for p in _BACKTICK.findall(line)
            if p.startswith("tests/") and p.split("::")[0].endswith(".py")
        ]
        cited = {t.split("[")[0] for t in re.findall(r"\btest_\w+(?:\[\w+\])?", line)}
        cited -= {Path(p).stem for p in _BACKTICK.findall(line)}
        names = set().union(*(_test_names(f) for f in files if f.exists())) if files else every
        problems += [t for t in sorted(cited) if t not in names and t not in every]
        problems += [str(f.relative_to(ROOT)) for f in files if not f.exists()]
    assert not problems, f"SECURITY.md cites tests that do not exist: {problems}"
