"""Read the tree's architecture off its imports: lines per package, imports that
break the layering rules, and import circles.

Run: python tools/layout_report.py [--json] [--check]

Layers, bottom to top: the floor (``kvmesh``, generated API included), the
services (``indexer``, ``router_client``, ``tee``, ``xfer``), the lab (``lab``:
everything that drives the whole stack on one machine). The rules
(:data:`RULES`): the floor imports no service and not the lab, no service
imports the lab, ``router_client`` imports no other service. Every import
counts, module-level, function-level and ``TYPE_CHECKING`` alike; relative
imports are resolved, and ``from pkg import sub`` naming a submodule imports
the submodule, not the package. A circle is a set of two or more modules that
reach each other through imports (a strongly connected component of the
module graph).

This file is also the library tests/unit/test_layering.py loads by its path
(tools/ is not a package and is not installed): the walker and the rules are
written once, here.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Package -> layer (0 floor, 1 service, 2 lab).
LAYERS: dict[str, int] = {
    "kvmesh": 0,
    "indexer": 1,
    "router_client": 1,
    "tee": 1,
    "xfer": 1,
    "lab": 2,
}

#: The generated protobuf stubs (tools/gen_protos.py): counted apart, never walked.
GENERATED_PACKAGE = "kvmesh.api"

SERVICES = ("indexer", "router_client", "tee", "xfer")


@dataclasses.dataclass(frozen=True)
class Rule:
    """Modules under ``package`` (``exempt`` subpackages aside) import none of ``forbidden``."""

    package: str
    forbidden: tuple[str, ...]
    why: str
    exempt: tuple[str, ...] = ()
    #: Modules of a forbidden package that may be imported all the same
    #: (exact names; what they import is held to the same list:
    #: :func:`allowed_closure_violations`).
    allowed: tuple[str, ...] = ()

    def applies_to(self, module: str) -> bool:
        """Whether ``module`` is under this rule's package and not exempt."""
        return _within(module, self.package) and not any(_within(module, e) for e in self.exempt)


#: The indexer modules a router's follower runs: the memory backend and what
#: it imports of the indexer (no server, no Redis, no logic).
FOLLOWER_CORE = (
    "indexer",
    "indexer.convert",
    "indexer.index",
    "indexer.memory",
    "indexer.model",
    "indexer.pacing",
    "indexer.watch",
)

#: The layering rules of the tree.
RULES: tuple[Rule, ...] = (
    Rule(
        "kvmesh",
        forbidden=(*SERVICES, "lab"),
        why="the floor (kvmesh) imports no service and not lab",
        exempt=(GENERATED_PACKAGE,),
    ),
    *(Rule(s, forbidden=("lab",), why="a service never imports lab") for s in SERVICES),
    Rule(
        "router_client",
        forbidden=("indexer", "tee", "xfer"),
        why="router_client depends on kvmesh and grpcio only, and the index core a follower holds",
        # A follower (router_client/follower.py) holds the memory backend's own
        # index, shared, not copied: that core and nothing else of the indexer.
        allowed=FOLLOWER_CORE,
    ),
)


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to an absolute module name."""

    module: str
    path: Path
    line: int
    target: str


@dataclasses.dataclass(frozen=True)
class Violation:
    """An import that breaks a :class:`Rule`."""

    imp: Import
    rule: Rule

    def describe(self, root: Path) -> str:
        """``file:line: module imports target (why)``, the file relative to ``root``."""
        i = self.imp
        rel = i.path.relative_to(root).as_posix() if i.path.is_relative_to(root) else i.path
        return f"{rel}:{i.line}: {i.module} imports {i.target} ({self.rule.why})"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def discover(root: Path = ROOT, packages: Iterable[str] = LAYERS) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of ``packages`` under ``root``."""
    mods: dict[str, Path] = {}
    for pkg in packages:
        base = root / pkg
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def is_generated(module: str) -> bool:
    """Whether ``module`` is a generated stub module (or package) of kvmesh/api."""
    return _within(module, GENERATED_PACKAGE)


def imports_of(path: Path, module: str, known: Iterable[str]) -> list[Import]:
    """Every import of the file ``path`` (module ``module``), wherever it stands.

    ``known`` are the tree's module names: ``from pkg import name`` imports
    ``pkg.name`` when that is a module, else ``pkg``.
    """
    known_set = set(known)
    tree = ast.parse(path.read_text("utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = _from_targets(node, module, is_pkg, known_set)
        else:
            continue
        found += [Import(module, path, node.lineno, t) for t in targets if t]
    return found


def _from_targets(node: ast.ImportFrom, module: str, is_pkg: bool, known: set[str]) -> list[str]:
    """The modules ``from X import a, b`` in ``module`` imports (relative X resolved)."""
    if node.level:
        base = module.split(".")
        drop = node.level - (1 if is_pkg else 0)
        if drop >= len(base):
            return []  # beyond the top-level package: not importable
        base = base[: len(base) - drop] if drop else base
        target = ".".join([*base, node.module] if node.module else base)
    else:
        target = node.module or ""
    targets = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
    if len(targets) < len(node.names):
        targets.append(target)
    return targets


def tree_imports(root: Path = ROOT) -> tuple[dict[str, Path], list[Import]]:
    """The tree's modules and the imports of every module that is not generated."""
    mods = discover(root)
    found: list[Import] = []
    for name, path in mods.items():
        if not is_generated(name):
            found += imports_of(path, name, mods)
    return mods, found


def violations(found: Iterable[Import], rules: Iterable[Rule] = RULES) -> list[Violation]:
    """The imports that break ``rules``, in file and line order."""
    out: list[Violation] = []
    rules = list(rules)
    for imp in found:
        top = imp.target.split(".")[0]
        out += [
            Violation(imp, r)
            for r in rules
            if r.applies_to(imp.module) and top in r.forbidden and imp.target not in r.allowed
        ]
    return sorted(out, key=lambda v: (str(v.imp.path), v.imp.line, v.imp.target))


def allowed_closure_violations(found: Iterable[Import], rules: Iterable[Rule] = RULES) -> list[str]:
    """Imports by a rule's allowed modules of their own package beyond the allowed
    list: what an allowed module imports comes along with it."""
    out: list[str] = []
    for r in rules:
        allowed = set(r.allowed)
        for imp in found:
            if imp.module in allowed:
                top = imp.target.split(".")[0]
                if top in r.forbidden and imp.target not in allowed:
                    out.append(
                        f"{imp.module} imports {imp.target} (allowed to {r.package}: "
                        f"it must stay within {sorted(allowed)})"
                    )
    return sorted(out)


def graph_of(mods: Mapping[str, Path], found: Iterable[Import]) -> dict[str, set[str]]:
    """Module -> the tree's modules it imports (generated modules left out)."""
    graph: dict[str, set[str]] = {m: set() for m in mods if not is_generated(m)}
    for imp in found:
        if imp.target in graph and imp.target != imp.module:
            graph[imp.module].add(imp.target)
    return graph


def sccs(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                out.append(comp)
    return out


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import circles: components of two or more modules, each sorted."""
    return sorted(sorted(c) for c in sccs(graph) if len(c) > 1)


def circle_edges(circle: Iterable[str], found: Iterable[Import], root: Path) -> list[str]:
    """The imports (``file:line: a imports b``) that close ``circle``."""
    members = set(circle)
    return sorted(
        f"{i.path.relative_to(root).as_posix()}:{i.line}: {i.module} imports {i.target}"
        for i in found
        if i.module in members and i.target in members and i.module != i.target
    )


def check(root: Path = ROOT) -> list[str]:
    """Every rule violation and every circle of the tree at ``root``, one line each."""
    mods, found = tree_imports(root)
    problems = [v.describe(root) for v in violations(found)]
    problems += allowed_closure_violations(found)
    for c in circles(graph_of(mods, found)):
        edges = "; ".join(circle_edges(c, found, root))
        problems.append(f"import circle {' <-> '.join(c)}: {edges}")
    return problems


@dataclasses.dataclass(frozen=True)
class Report:
    """The figures of the tree: lines per package, rule violations, back-up pairs, circles."""

    lines: dict[str, int]
    violations: list[str]
    back_up_pairs: list[str]
    circles: list[list[str]]

    def failed(self) -> bool:
        """Whether a rule is broken or a circle exists."""
        return bool(self.violations or self.circles)


def report(root: Path = ROOT) -> Report:
    """The figures of the tree at ``root``."""
    mods, found = tree_imports(root)
    lines: dict[str, int] = {}
    for name, path in mods.items():
        pkg = name.split(".")[0]
        key = f"{pkg} (generated)" if is_generated(name) else pkg
        lines[key] = lines.get(key, 0) + len(path.read_text("utf-8").splitlines())
    back_up = {
        (i.module.split(".")[0], i.target.split(".")[0])
        for i in found
        if i.target in mods and LAYERS[i.target.split(".")[0]] > LAYERS[i.module.split(".")[0]]
    }
    return Report(
        lines=dict(sorted(lines.items())),
        violations=[v.describe(root) for v in violations(found)],
        back_up_pairs=sorted(f"{a} -> {b}" for a, b in back_up),
        circles=circles(graph_of(mods, found)),
    )


def main() -> int:
    """Print the report; with ``--check``, exit 1 when a rule is broken or a circle exists."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 on a rule violation or an import circle"
    )
    ns = parser.parse_args()
    rep = report()
    if ns.json:
        print(json.dumps(dataclasses.asdict(rep), indent=2))
    else:
        print(f"{'package':<28}{'lines':>8}")
        for pkg, n in rep.lines.items():
            print(f"{pkg:<28}{n:>8}")
        print(f"\nimports that break a layering rule ({len(rep.violations)}):")
        for v in rep.violations:
            print(f"  {v}")
        print(f"\nimports that run back up ({len(rep.back_up_pairs)}):")
        for pair in rep.back_up_pairs:
            print(f"  {pair}")
        print(f"\nimport circles ({len(rep.circles)}):")
        for c in rep.circles:
            print("  " + " <-> ".join(c))
    return 1 if ns.check and rep.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
