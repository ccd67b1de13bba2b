"""The tree keeps its layers: the floor imports no service and not lab, no service
imports lab, router_client imports no other service, and no modules import each
other in a circle.

The walker and the rules live in tools/layout_report.py (the report of the
same figures), loaded here by its path: they are written once.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_layout_report() -> ModuleType:
    """tools/layout_report.py as a module (tools/ is not a package)."""
    name = "kvmesh_tools_layout_report"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "layout_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclasses look their module up by name.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


layout = _load_layout_report()


def test_every_package_of_the_tree_is_walked() -> None:
    mods = layout.discover(ROOT)
    for pkg in ("kvmesh", "indexer", "tee", "xfer", "router_client", "lab"):
        assert pkg in mods, pkg
    assert "kvmesh.cli" in mods and "lab.up" in mods
    assert any(layout.is_generated(m) for m in mods)


def test_the_tree_keeps_its_layers() -> None:
    _, found = layout.tree_imports(ROOT)
    broken = [v.describe(ROOT) for v in layout.violations(found)]
    assert not broken, "imports against the layering rules:\n" + "\n".join(broken)


def test_the_follower_core_imports_only_itself_of_the_indexer() -> None:
    """router_client may import the index core a follower holds (FOLLOWER_CORE),
    and that core nothing else of the indexer: no server, Redis or logic comes
    into a router with it."""
    _, found = layout.tree_imports(ROOT)
    assert layout.allowed_closure_violations(found) == []
    # It can fail: the memory backend importing the logic would be caught.
    fake = layout.Import("indexer.memory", ROOT / "indexer/memory.py", 1, "indexer.logic")
    assert layout.allowed_closure_violations([fake])
    # And an import of the indexer beyond the core by router_client is a violation.
    beyond = layout.Import(
        "router_client.follower", ROOT / "router_client/follower.py", 1, "indexer.server"
    )
    assert layout.violations([beyond])
    inside = layout.Import(
        "router_client.follower", ROOT / "router_client/follower.py", 1, "indexer.memory"
    )
    assert not layout.violations([inside])


def test_the_tree_has_no_import_circles() -> None:
    mods, found = layout.tree_imports(ROOT)
    found_circles = layout.circles(layout.graph_of(mods, found))
    lines = [
        " <-> ".join(c) + "\n    " + "\n    ".join(layout.circle_edges(c, found, ROOT))
        for c in found_circles
    ]
    assert not found_circles, "import circles:\n" + "\n".join(lines)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


#: A small tree with one import of each forbidden kind, one circle, and imports
#: that look alike but break nothing.
SYNTHETIC: dict[str, str] = {
    "kvmesh/__init__.py": "",
    # Function-level import of a service from the floor: a violation.
    "kvmesh/cli.py": "def main():\n    from indexer import cli\n    return cli\n",
    # TYPE_CHECKING import of lab from the floor: a violation.
    "kvmesh/tls.py": (
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import lab.sim\n"
    ),
    # Generated stubs are not walked.
    "kvmesh/api/__init__.py": "",
    "kvmesh/api/x/__init__.py": "",
    "kvmesh/api/x/v1/__init__.py": "",
    "kvmesh/api/x/v1/x_pb2.py": "import indexer\n",
    "indexer/__init__.py": "",
    # A circle of three: a relative import, a package __init__, ``from pkg import sub``.
    "indexer/server.py": "from . import api\n\nimport kvmesh.tls\n",
    "indexer/api/__init__.py": "from indexer.api import server\n",
    "indexer/api/server.py": "from indexer import server\n",
    # ``from pkg import sub``: the submodule, not the package __init__ (no circle).
    "indexer/sub/__init__.py": "from indexer.sub import leaf\n",
    "indexer/sub/leaf.py": "from indexer.sub import other\n",
    "indexer/sub/other.py": "X = 1\n",
    # A service importing lab: a violation.
    "tee/__init__.py": "",
    "tee/bench.py": "from lab.bench import tee as _t\n",
    # router_client importing another service: a violation; the floor is fine.
    "router_client/__init__.py": "",
    "router_client/client.py": ("from kvmesh.api.x.v1 import x_pb2\n\nimport xfer.logic\n"),
    "xfer/__init__.py": "",
    "xfer/logic.py": "from kvmesh import tls\n",
    # lab imports services freely.
    "lab/__init__.py": "",
    "lab/bench/__init__.py": "",
    "lab/bench/tee.py": "import tee\nfrom indexer.server import api\n",
    "lab/sim/__init__.py": "",
}


def test_the_checker_reports_violations_and_circles_of_a_synthetic_tree(
    tmp_path: Path,
) -> None:
    _write(tmp_path, SYNTHETIC)
    problems = layout.check(tmp_path)
    violations = [p for p in problems if not p.startswith("import circle")]
    assert violations == [
        "kvmesh/cli.py:2: kvmesh.cli imports indexer (the floor (kvmesh) imports no service "
        "and not lab)",
        "kvmesh/tls.py:4: kvmesh.tls imports lab.sim (the floor (kvmesh) imports no service "
        "and not lab)",
        "router_client/client.py:3: router_client.client imports xfer.logic (router_client "
        "depends on kvmesh and grpcio only, and the index core a follower holds)",
        "tee/bench.py:1: tee.bench imports lab.bench.tee (a service never imports lab)",
    ], problems
    found_circles = [p for p in problems if p.startswith("import circle")]
    assert len(found_circles) == 1, problems
    assert found_circles[0].startswith(
        "import circle indexer.api <-> indexer.api.server <-> indexer.server:"
    )
    assert "indexer/api/server.py:1: indexer.api.server imports indexer.server" in found_circles[0]
    assert "indexer/server.py:1: indexer.server imports indexer.api" in found_circles[0]
    assert "indexer/api/__init__.py:1: indexer.api imports indexer.api.server" in found_circles[0]


def test_relative_imports_resolve_against_the_package(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "tee/__init__.py": "from . import a\n",
            "tee/a.py": "from .b import X\nfrom .. import lab\n",
            "tee/b.py": "from . import a as _a\n",
            "tee/c/__init__.py": "from ..a import Y\n",
        },
    )
    mods = layout.discover(tmp_path)
    targets = {
        (i.module, i.target)
        for name, path in mods.items()
        for i in layout.imports_of(path, name, mods)
    }
    # ``from .. import lab`` in tee.a leaves the top-level package: not an import.
    assert targets == {
        ("tee", "tee.a"),
        ("tee.a", "tee.b"),
        ("tee.b", "tee.a"),
        ("tee.c", "tee.a"),
    }
    assert layout.circles(layout.graph_of(mods, layout.tree_imports(tmp_path)[1])) == [
        ["tee.a", "tee.b"]
    ]


@pytest.mark.parametrize(
    ("module", "target", "broken"),
    [
        ("kvmesh.cli", "indexer.cli", True),
        ("kvmesh.api.x.v1.x_pb2", "indexer", False),
        ("kvmesh.tls", "kvmesh.api.x.v1", False),
        ("indexer.server", "lab", True),
        ("indexer.server", "tee.logic", False),
        ("router_client.router", "tee", True),
        ("router_client.router", "kvmesh.api.indexer.v1", False),
        ("lab.up", "xfer.server", False),
        ("labx.y", "lab", False),
    ],
)
def test_rules(module: str, target: str, broken: bool) -> None:
    imp = layout.Import(module, ROOT / "x.py", 1, target)
    assert bool(layout.violations([imp])) is broken
