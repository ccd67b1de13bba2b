"""Docker's .dockerignore rules as dockerignore.py applies them, and the Dockerfile reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.install import dockerfile
from tests.install.dockerignore import DockerIgnore, parse


def _ignore(*lines: str) -> DockerIgnore:
    return DockerIgnore.from_text("\n".join(lines))


@pytest.mark.parametrize(
    ("pattern", "path", "excluded"),
    [
        # A name matches at the root only (unlike .gitignore), and everything under it.
        ("tests", "tests", True),
        ("tests", "tests/unit/test_x.py", True),
        ("tests", "indexer/tests/x.py", False),
        ("*.egg-info", "kvmesh.egg-info/PKG-INFO", True),
        ("*.egg-info", "sub/kvmesh.egg-info/PKG-INFO", False),
        # A trailing slash and a leading slash mean nothing.
        ("build/", "build/lib/x.py", True),
        ("/docs", "docs/api.md", True),
        # ``*`` and ``?`` never cross a slash.
        ("lab/*.py", "lab/up.py", True),
        ("lab/*.py", "lab/up/view.py", False),
        ("lab/?p", "lab/up/view.py", True),
        # ``**`` is any number of folders, none included.
        ("**/__pycache__", "__pycache__/x.pyc", True),
        ("**/__pycache__", "kvmesh/api/__pycache__/x.pyc", True),
        ("**/__pycache__", "kvmesh/not__pycache__/x.py", False),
        ("**/*.py[cod]", "tee/cachesim/model.pyc", True),
        ("**/*.py[cod]", "tee/cachesim/model.py", False),
        ("lab/**", "lab/data/trace.gz", True),
        ("lab/**", "lab", False),
        ("a/**/b", "a/b", True),
        ("a/**/b", "a/x/y/b/c", True),
        # Characters regular expressions would read as operators are literal.
        ("bench-*.json", "bench-1.json", True),
        ("bench-*.json", "bench-1xjson", False),
        ("a+b", "a+b", True),
        ("a+b", "aab", False),
    ],
)
def test_pattern(pattern: str, path: str, excluded: bool) -> None:
    assert _ignore(pattern).excluded(path) is excluded


def test_exceptions_and_the_last_matching_line_wins() -> None:
    ignore = _ignore("docs", "!docs/keep.md", "*.md", "!README.md")
    assert ignore.excluded("docs/api.md")
    assert ignore.excluded("docs/keep.md") is False
    assert ignore.excluded("SECURITY.md")
    assert ignore.excluded("README.md") is False
    # A later exclusion wins over an earlier exception.
    assert _ignore("!keep", "keep").excluded("keep")


def test_comments_blank_lines_and_cleaning() -> None:
    patterns = parse("# a comment\n\n  build//lib/  \n /dist\n!  ./x\n \t# not a comment\n")
    assert [(p.text, p.exception) for p in patterns] == [
        ("build/lib", False),
        ("dist", False),
        ("x", True),
        ("# not a comment", False),
    ]
    with pytest.raises(ValueError, match="'!' alone"):
        parse("!\n")


def test_context_walk_enters_an_excluded_folder_only_for_an_exception(tmp_path: Path) -> None:
    for rel in ("a/x.py", "a/b/y.py", "t/k.txt", "t/u/v.txt", "w/k.txt", "top.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    ignore = _ignore("t", "!t/k.txt", "w", "!**/k.txt", "a/b")
    # Docker enters t/ for the exception naming a path under it, never w/ for a wildcard.
    assert list(ignore.context_files(tmp_path)) == ["top.txt", "a/x.py", "t/k.txt"]


def test_dockerfile_reader() -> None:
    text = "\n".join(
        [
            "FROM python:3.11-slim AS build",
            "WORKDIR /src",
            "COPY . .",
            "RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .",
            "FROM python:3.11-slim",
            "ARG WITH_X=1",
            "ENV A=1 \\",
            '    B="two words"',
            "RUN pip install /wheels/*.whl \\",
            "    # a comment inside the continuation",
            '    && if [ "$WITH_X" = "1" ]; then pip install --no-deps x==1; fi \\',
            '    && if [ "$WITH_X" = "0" ]; then pip install y; fi \\',
            "    && rm -rf /wheels && useradd --uid 10001 u",
        ]
    )
    build, runtime = dockerfile.stages(text)
    assert (build.name, build.workdir, build.copies) == ("build", "/src", [". ."])
    assert dockerfile.pip_commands(build) == [
        ["wheel", "--no-cache-dir", "--no-deps", "--wheel-dir", "/wheels", "."]
    ]
    assert runtime.args == {"WITH_X": "1"}
    assert runtime.env == {"A": "1", "B": "two words"}
    assert dockerfile.pip_commands(runtime) == [
        ["install", "/wheels/*.whl"],
        ["install", "--no-deps", "x==1"],
    ]
    runtime.runs.append("apt-get install -y curl")
    with pytest.raises(ValueError, match="apt-get"):
        dockerfile.pip_commands(runtime)
