"""``kvmesh replay --grid``: the routing replay over traces, router counts, caches and loads.

Each cell of the grid is one trace family at one router count ``R``, one
cache size (blocks per worker) and one load (:mod:`lab.sim.replay`, ``--load``
on its basis), replayed through every policy. The traces are the bundled
conversation trace (``conversation``) and the families of :mod:`lab.synth`
(``chat``, ``agent``, ``rag``, ``bursty``), generated in process with the
seed :data:`FAMILY_SEED`; ``--grid-requests N`` keeps each trace to N
requests (the bundled one's first N; a family generated with N) so the whole
grid runs in minutes. One P2C replay at speed 1 per (family, R, cache) gives
the load basis of its loads (:func:`lab.sim.replay.basis_utilisation`);
those cells form a group, and ``--grid-jobs J`` runs J groups at once, each
in a process of its own (the default grid is about 230 CPU-seconds: about
two minutes with two jobs on two free cores).

Per cell the grid judges cache_shared against the other policies
(:func:`judge`, from the cell's figures alone):

- the ratio of its TTFT p95 to P2C's, whether it has the lowest TTFT p95 and
  the highest goodput of all policies, its hit rate as a fraction of the
  pooled bound and its request CV over P2C's;
- target (a), at loads from :data:`TARGET_A_LOAD`: TTFT p95 at most
  :data:`TARGET_A_RATIO` times P2C's and the lowest of all, goodput the
  highest (not judged below that load);
- target (b): hit rate at least :data:`TARGET_B_POOL` of the pooled bound and
  request CV at most :data:`TARGET_B_CV` times P2C's.

**Variants** (``--grid-variants NAME:FIELD=VALUE,...``, :class:`Variant`):
each is one more cache_shared run per cell, labelled ``cache_shared[NAME]``,
with those :class:`lab.sim.replay.ReplaySettings` fields replaced (a field of
a nested settings class as ``service.max_running=16``), at the cell's speed
(the same arrivals), and judged the same way against the other policies.
Field names and values are checked against ReplaySettings' own fields and
types, so any field it has can be varied.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import sys
import time
import types
import typing
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Union

from kvmesh import progress
from lab.bench.report import write_report
from lab.sim.replay import (
    POLICIES,
    PolicyResult,
    ReplayResult,
    ReplaySettings,
    Utilisation,
    basis_utilisation,
    build_parser,
    check_args,
    cost_label,
    int_list,
    plotting_available,
    run_args,
    run_replay,
    settings_of,
)
from lab.synth import FAMILIES, family, synthesize
from lab.traces import TraceRequest, load_mooncake

#: The bundled Mooncake conversation trace among the grid's families.
CONVERSATION = "conversation"

#: Seed of the generated families.
FAMILY_SEED = 0

#: Target (a) is judged at loads from this one.
TARGET_A_LOAD = 0.7
#: Target (a): cache_shared's TTFT p95 at most this times P2C's.
TARGET_A_RATIO = 0.6
#: Target (b): hit rate at least this fraction of the pooled bound...
TARGET_B_POOL = 0.95
#: ... and request CV at most this times P2C's.
TARGET_B_CV = 1.2

#: The subject every cell judges; variants are ``cache_shared[NAME]``.
SUBJECT = "cache_shared"


def grid_families() -> list[str]:
    """Every family the grid can replay: the bundled trace, then lab.synth's."""
    return [CONVERSATION, *FAMILIES]


def grid_trace(name: str, requests: int | None) -> list[TraceRequest]:
    """The trace of family ``name``, ``requests`` long (None: the bundled trace
    whole, a family's own default length)."""
    if name == CONVERSATION:
        return load_mooncake(limit=requests)
    fam = family(name) if requests is None else family(name, requests=requests)
    return synthesize(fam, seed=FAMILY_SEED).requests


# -- variants ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Variant:
    """One more cache_shared run per cell with some ReplaySettings fields replaced."""

    name: str
    #: (field, value) pairs; a dotted field sets a field of a nested settings class.
    overrides: tuple[tuple[str, Any], ...]

    @property
    def label(self) -> str:
        """The run's policy label in the tables and figures."""
        return f"{SUBJECT}[{self.name}]"

    def apply(self, settings: ReplaySettings) -> ReplaySettings:
        """``settings`` with the overrides replaced."""
        top: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {}
        for name, value in self.overrides:
            outer, dot, inner = name.partition(".")
            if dot:
                nested.setdefault(outer, {})[inner] = value
            else:
                top[name] = value
        for outer, fields in nested.items():
            top[outer] = replace(top.get(outer, getattr(settings, outer)), **fields)
        return replace(settings, **top)


def parse_variant(text: str) -> Variant:
    """``NAME:FIELD=VALUE,FIELD=VALUE`` as a :class:`Variant`; raises ``ValueError``
    naming what is wrong (an unknown field, a value its type does not take)."""
    name, colon, body = text.partition(":")
    name = name.strip()
    if not colon or not name or not body.strip():
        raise ValueError(f"variant {text!r}: expected NAME:FIELD=VALUE[,FIELD=VALUE...]")
    overrides = []
    for item in body.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"variant {name!r}: expected FIELD=VALUE, got {item!r}")
        overrides.append((key, _field_value(name, key, value.strip())))
    return Variant(name, tuple(overrides))


def _field_value(variant: str, name: str, text: str) -> Any:
    """``text`` as a value of ReplaySettings field ``name`` (dotted: of a nested one)."""
    owner: type = ReplaySettings
    parts = name.split(".")
    for depth, part in enumerate(parts):
        hints = typing.get_type_hints(owner)
        if part not in hints or part.startswith("_"):
            known = ", ".join(f.name for f in dataclasses.fields(owner))
            raise ValueError(
                f"variant {variant!r}: {owner.__name__} has no field {part!r} "
                f"(in {name!r}; its fields: {known})"
            )
        hint = hints[part]
        if depth < len(parts) - 1:
            if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
                raise ValueError(f"variant {variant!r}: field {part!r} has no fields of its own")
            owner = hint
    try:
        return _convert(hint, text)
    except ValueError as e:
        raise ValueError(f"variant {variant!r}: field {name!r}: {e}") from None


def _convert(hint: Any, text: str) -> Any:
    """``text`` as a value of type ``hint``: a number, a bool, a string, a Literal's
    choice, None for an optional one; raises ``ValueError``."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        for choice in typing.get_args(hint):
            if str(choice) == text:
                return choice
        raise ValueError(f"choose from {', '.join(map(str, typing.get_args(hint)))}")
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if type(None) in args and text.lower() == "none":
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _convert(rest[0], text)
    if hint is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a bool: {text!r}")
    if hint in (int, float, str):
        try:
            return hint(text)
        except ValueError:
            raise ValueError(f"not {hint.__name__}: {text!r}") from None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        raise ValueError("set its fields one by one, as FIELD.NAME=VALUE")
    raise ValueError(f"a {hint} cannot be given as text")


# -- the grid ----------------------------------------------------------------------


@dataclass(slots=True)
class GridSettings:
    """What the grid runs: the axes, the policies, the variants, the base settings.

    ``base`` holds everything the axes do not set (workers, seed, balance,
    service model, event lag, SLO, load view); each cell replaces its
    ``routers``, ``capacity``, ``load`` and ``trace``.
    """

    base: ReplaySettings = field(default_factory=ReplaySettings)
    routers: list[int] = field(default_factory=lambda: [4, 8])
    capacities: list[int] = field(default_factory=lambda: [500, 2000])
    loads: list[float] = field(default_factory=lambda: [0.5, 0.7, 0.9])
    families: list[str] = field(default_factory=grid_families)
    requests: int | None = 2000
    policies: list[str] = field(default_factory=lambda: list(POLICIES))
    variants: list[Variant] = field(default_factory=list)

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad axis."""
        known = grid_families()
        bad = [f for f in self.families if f not in known]
        if bad or not self.families:
            raise ValueError(f"unknown family {bad}; choose from {', '.join(known)}")
        if not self.routers or min(self.routers) < 1:
            raise ValueError("--grid-routers needs router counts >= 1")
        if not self.capacities or min(self.capacities) < 0:
            raise ValueError("--grid-capacities needs capacities >= 0")
        if not self.loads or min(self.loads) <= 0:
            raise ValueError("--grid-loads needs loads > 0")
        if self.requests is not None and self.requests < 2:
            raise ValueError("--grid-requests must be >= 2")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise ValueError(f"unknown policy {unknown}; choose from {', '.join(POLICIES)}")
        if "p2c" not in self.policies or SUBJECT not in self.policies:
            raise ValueError("the grid judges cache_shared against p2c: run both")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names repeat: {names}")


@dataclass(frozen=True, slots=True)
class Verdict:
    """How one subject (cache_shared or a variant) did in one cell (module docstring)."""

    subject: str
    ttft_p95_ratio: float
    lowest_ttft_p95: bool
    best_goodput: bool
    pool_fraction: float
    worker_cv_ratio: float
    #: None below :data:`TARGET_A_LOAD`: not judged.
    target_a: bool | None
    target_b: bool


@dataclass(slots=True)
class Cell:
    """One cell: a family at one router count, cache size and load."""

    family: str
    routers: int
    capacity: int
    load: float
    result: ReplayResult
    verdicts: list[Verdict]

    @property
    def key(self) -> str:
        """The prefix of the cell's figures in ``--json``."""
        return f"{self.family}_R{self.routers}_C{self.capacity}_L{self.load:g}"


@dataclass(slots=True)
class GridResult:
    """Every cell, what was run and how long it took."""

    settings: GridSettings
    cells: list[Cell]
    seconds: float
    #: Requests of every family's trace as replayed.
    requests: dict[str, int]

    @property
    def subjects(self) -> list[str]:
        """cache_shared, then the variants' labels."""
        return [SUBJECT, *(v.label for v in self.settings.variants)]

    def figures(self) -> dict[str, float]:
        """The flat figures of ``--json``: every cell's replay figures and verdicts
        under the cell's key, and the pass counts per subject and target."""
        out: dict[str, float] = {"grid_seconds": self.seconds, "cells": len(self.cells)}
        for c in self.cells:
            for name, value in c.result.figures().items():
                out[f"{c.key}_{name}"] = value
            for v in c.verdicts:
                pre = f"{c.key}_{v.subject}"
                out[f"{pre}_ttft_p95_ratio"] = v.ttft_p95_ratio
                out[f"{pre}_lowest_ttft_p95"] = float(v.lowest_ttft_p95)
                out[f"{pre}_best_goodput"] = float(v.best_goodput)
                out[f"{pre}_pool_fraction"] = v.pool_fraction
                out[f"{pre}_worker_cv_ratio"] = v.worker_cv_ratio
                if v.target_a is not None:
                    out[f"{pre}_target_a"] = float(v.target_a)
                out[f"{pre}_target_b"] = float(v.target_b)
        for subject, (a, a_cells, b, b_cells) in self.passes().items():
            out[f"{subject}_target_a_passed"] = a
            out[f"{subject}_target_a_cells"] = a_cells
            out[f"{subject}_target_b_passed"] = b
            out[f"{subject}_target_b_cells"] = b_cells
        return out

    def passes(self) -> dict[str, tuple[int, int, int, int]]:
        """Per subject: cells passing (a), cells judged on (a), passing (b), cells."""
        out = {}
        for subject in self.subjects:
            vs = [v for c in self.cells for v in c.verdicts if v.subject == subject]
            judged = [v for v in vs if v.target_a is not None]
            out[subject] = (
                sum(1 for v in judged if v.target_a),
                len(judged),
                sum(1 for v in vs if v.target_b),
                len(vs),
            )
        return out

    def params(self) -> dict[str, Any]:
        """What was run (the ``params`` of ``--json``)."""
        g = self.settings
        return {
            **asdict(g.base),
            "grid_routers": g.routers,
            "grid_capacities": g.capacities,
            "grid_loads": g.loads,
            "grid_families": g.families,
            "grid_requests": g.requests,
            "family_seed": FAMILY_SEED,
            "requests": self.requests,
            "policies": g.policies,
            "variants": {v.name: dict(v.overrides) for v in g.variants},
        }


def judge(
    figures: Mapping[str, float], subject: str, others: Sequence[str], load: float
) -> Verdict:
    """``subject``'s verdict in a cell from the cell's figures (:meth:`ReplayResult.figures`)
    against the policies ``others`` (p2c among them)."""

    def f(policy: str, name: str) -> float:
        return figures[f"{policy}_{name}"]

    p95 = f(subject, "ttft_p95_ms")
    goodput = f(subject, "goodput")
    ratio = _ratio(p95, f("p2c", "ttft_p95_ms"))
    lowest = all(p95 <= f(o, "ttft_p95_ms") for o in others)
    best = all(goodput >= f(o, "goodput") for o in others)
    pool = f(subject, "bound_fraction")
    cv = _ratio(f(subject, "worker_cv"), f("p2c", "worker_cv"))
    target_a = None
    if load >= TARGET_A_LOAD:
        target_a = ratio <= TARGET_A_RATIO and lowest and best
    return Verdict(
        subject=subject,
        ttft_p95_ratio=ratio,
        lowest_ttft_p95=lowest,
        best_goodput=best,
        pool_fraction=pool,
        worker_cv_ratio=cv,
        target_a=target_a,
        target_b=pool >= TARGET_B_POOL and cv <= TARGET_B_CV,
    )


def _ratio(a: float, b: float) -> float:
    """``a / b``; 1 when both are 0, infinite when only ``b`` is."""
    if b > 0:
        return a / b
    return 1.0 if a <= 0 else float("inf")


def run_grid(g: GridSettings, jobs: int = 1) -> GridResult:
    """Every cell of the grid (module docstring), in family, R, capacity, load order.

    The cells of one (family, R, capacity) share a load basis and run in one
    group; ``jobs`` > 1 runs that many groups at once, each in a process of
    its own (one replay is one thread's work).
    """
    g.check()
    t0 = time.perf_counter()
    groups = [(fam, n, cap) for fam in g.families for n in g.routers for cap in g.capacities]
    done: list[tuple[list[Cell], int]] = []
    if jobs <= 1:
        traces: dict[str, list[TraceRequest]] = {}
        for fam, n, cap in groups:
            trace = traces.get(fam)
            if trace is None:
                trace = traces[fam] = grid_trace(fam, g.requests)
            done.append((asyncio.run(_run_group(g, fam, n, cap, trace)), len(trace)))
    else:
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=spawn) as pool:
            done = list(pool.map(_group_in_process, [(g, *x) for x in groups]))
    cells = [c for group, _ in done for c in group]
    requests = {group[0].family: n for group, n in done if group}
    return GridResult(g, cells, time.perf_counter() - t0, requests)


def _group_in_process(job: tuple[GridSettings, str, int, int]) -> tuple[list[Cell], int]:
    """One group in a worker process: its trace generated there, its cells."""
    g, fam, n, cap = job
    trace = grid_trace(fam, g.requests)
    return asyncio.run(_run_group(g, fam, n, cap, trace)), len(trace)


async def _run_group(
    g: GridSettings, fam: str, n: int, cap: int, trace: Sequence[TraceRequest]
) -> list[Cell]:
    """The cells of ``fam`` at ``n`` routers and ``cap`` blocks, one per load."""
    others = [p for p in g.policies if p != SUBJECT]
    at = replace(g.base, routers=n, capacity=cap, trace=fam)
    basis = await basis_utilisation(trace, at)
    cells = []
    for load in g.loads:
        progress.phase(f"grid: {fam}, R={n}, {cap} blocks, load {load:g}")
        result = await run_replay(trace, replace(at, load=load), g.policies, basis=basis)
        for v in g.variants:
            result.results.append(await _variant_run(trace, result, v, basis))
        figures = result.figures()
        verdicts = [judge(figures, s, others, load) for s in _subjects(g)]
        cells.append(Cell(fam, n, cap, load, result, verdicts))
    return cells


def _subjects(g: GridSettings) -> list[str]:
    return [SUBJECT, *(v.label for v in g.variants)]


async def _variant_run(
    trace: Sequence[TraceRequest], cell: ReplayResult, v: Variant, basis: Utilisation
) -> PolicyResult:
    """cache_shared with ``v``'s settings at the cell's speed, labelled ``v.label``."""
    settings = v.apply(replace(cell.settings, load=None))
    ran = await run_replay(trace, settings, [SUBJECT], basis=basis)
    return replace(ran.results[0], policy=v.label)


# -- output ------------------------------------------------------------------------


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else "pass" if ok else "FAIL"


def format_grid(grid: GridResult) -> str:
    """The grid's table: one line per cell and subject, then the pass counts."""
    g = grid.settings
    b = g.base
    fam_w = max(len(f) for f in g.families)
    sub_w = max(len(s) for s in grid.subjects)
    sizes = ", ".join(f"{f} {n:,}" for f, n in grid.requests.items())
    lines = [
        f"routing grid: W={b.workers} workers, policies {','.join(g.policies)}, seed "
        f"{b.seed}, {cost_label(b)}, load basis {b.load_basis}, load view {b.load_view}"
        + (f" (reports every {b.load_report_s * 1000:g} ms)" if b.load_report_s > 0 else ""),
        f"requests per trace: {sizes} (families generated with seed {FAMILY_SEED})",
        "",
        f"{'family':<{fam_w}} {'R':>3} {'cap':>5} {'load':>5} {'speed':>7} "
        f"{'subject':<{sub_w}} {'p95/p2c':>8} {'lowest':>7} {'best gp':>8} {'of pool':>8} "
        f"{'CV/p2c':>7} {'(a)':>5} {'(b)':>5}",
    ]
    for c in grid.cells:
        for v in c.verdicts:
            lines.append(
                f"{c.family:<{fam_w}} {c.routers:>3} {c.capacity:>5} {c.load:>5g} "
                f"{c.result.settings.speed:>6.3g}x {v.subject:<{sub_w}} "
                f"{v.ttft_p95_ratio:>8.2f} {'yes' if v.lowest_ttft_p95 else 'no':>7} "
                f"{'yes' if v.best_goodput else 'no':>8} {v.pool_fraction:>8.1%} "
                f"{v.worker_cv_ratio:>7.2f} {_mark(v.target_a):>5} {_mark(v.target_b):>5}"
            )
    lines += [
        "",
        f"(a) at load >= {TARGET_A_LOAD:g}: TTFT p95 <= {TARGET_A_RATIO:g}x P2C's and the "
        "lowest of all policies, goodput the highest; (b) hit rate >= "
        f"{TARGET_B_POOL:.0%} of the pooled bound and request CV <= {TARGET_B_CV:g}x P2C's",
    ]
    for subject, (a, a_cells, b_pass, cells) in grid.passes().items():
        lines.append(f"{subject}: (a) passed {a}/{a_cells} cells, (b) {b_pass}/{cells}")
    lines.append(f"{len(grid.cells)} cells in {grid.seconds:.0f} s")
    return "\n".join(lines)


#: The heat maps' rows: a verdict's figure, its title, the colour range, and
#: whether lower is better.
_MAPS = (
    ("ttft_p95_ratio", "TTFT p95 / P2C's", (0.0, 1.5), True),
    ("pool_fraction", "hit rate / pooled bound", (0.5, 1.0), False),
    ("worker_cv_ratio", "request CV / P2C's", (0.0, 3.0), True),
)


def plot_grid(grid: GridResult, path: str | Path) -> list[Path]:
    """Heat maps of the grid, one PNG per subject (``path`` for cache_shared,
    ``<stem>-<variant><suffix>`` for a variant): a row per figure of :data:`_MAPS`,
    a column per (R, cache), families down and loads across, each cell marked
    with its targets. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = grid.settings
    base = Path(path)
    columns = [(n, cap) for n in g.routers for cap in g.capacities]
    written = []
    for subject in grid.subjects:
        verdicts = {
            (c.family, c.routers, c.capacity, c.load): v
            for c in grid.cells
            for v in c.verdicts
            if v.subject == subject
        }
        fig, axes = plt.subplots(
            len(_MAPS),
            len(columns),
            figsize=(2.6 * len(columns) + 2.5, (0.35 * len(g.families) + 1.4) * len(_MAPS) + 0.8),
            squeeze=False,
            layout="constrained",
        )
        for row, (name, title, (lo, hi), lower_better) in enumerate(_MAPS):
            cmap = "RdYlGn_r" if lower_better else "RdYlGn"
            for col, (n, cap) in enumerate(columns):
                ax = axes[row][col]
                values = [
                    [getattr(verdicts[fam, n, cap, load], name) for load in g.loads]
                    for fam in g.families
                ]
                image = ax.imshow(values, cmap=cmap, vmin=lo, vmax=hi, aspect="auto")
                for i, fam in enumerate(g.families):
                    for j, load in enumerate(g.loads):
                        v = verdicts[fam, n, cap, load]
                        ok = v.target_b if name != "ttft_p95_ratio" else v.target_a
                        mark = "" if ok is None else (" +" if ok else " -")
                        ax.text(
                            j, i, f"{values[i][j]:.2f}{mark}", ha="center", va="center", fontsize=8
                        )
                ax.set_xticks(range(len(g.loads)), [f"{x:g}" for x in g.loads])
                ax.set_yticks(range(len(g.families)), g.families if col == 0 else [])
                ax.set_title(f"{title}\nR={n}, {cap} blocks", fontsize=9)
                if row == len(_MAPS) - 1:
                    ax.set_xlabel("load")
            fig.colorbar(image, ax=list(axes[row]), shrink=0.8)
        fig.suptitle(
            f"{subject}, W={g.base.workers}: +/- target (a) passed/failed (TTFT row),\n"
            "target (b) passed/failed (hit and CV rows)"
        )
        out = (
            base
            if subject == SUBJECT
            else base.with_name(f"{base.stem}-{subject[len(SUBJECT) + 1 : -1]}{base.suffix}")
        )
        fig.savefig(out, dpi=100)
        plt.close(fig)
        written.append(out)
    return written


# -- command line ------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The grid's flags on ``kvmesh replay``'s parser."""
    g = p.add_argument_group("grid (--grid)")
    g.add_argument(
        "--grid",
        action="store_true",
        help="replay the grid of families x routers x capacities x loads and judge "
        "cache_shared per cell (the --routers, --capacity and trace flags give way to it)",
    )
    g.add_argument("--grid-routers", default="4,8", help="router counts")
    g.add_argument("--grid-capacities", default="500,2000", help="KV cache blocks per engine")
    g.add_argument("--grid-loads", default="0.5,0.7,0.9", help="target utilisations")
    g.add_argument(
        "--grid-families",
        default=",".join(grid_families()),
        help=f"traces: {CONVERSATION} (the bundled one) and lab.synth's families",
    )
    g.add_argument(
        "--grid-requests",
        type=int,
        default=2000,
        metavar="N",
        help="requests per trace (0: the bundled trace whole, a family's default length)",
    )
    g.add_argument(
        "--grid-variants",
        action="append",
        default=None,
        metavar="NAME:FIELD=VALUE,...",
        help="one more cache_shared run per cell with these ReplaySettings fields replaced, "
        "labelled cache_shared[NAME] (repeatable), e.g. bal0.5:balance=0.5",
    )
    g.add_argument(
        "--grid-jobs",
        type=int,
        default=1,
        metavar="J",
        help="run J (family, R, capacity) groups at once, each in its own process",
    )
    g.add_argument("--png", dest="png_path", default=None, help="write the grid's heat maps here")


def _grid_flags_given(args: argparse.Namespace) -> list[str]:
    """The grid-only flags given without ``--grid``."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    defaults = vars(p.parse_args([]))
    return [
        f"--{name.replace('_', '-').removesuffix('-path')}"
        for name, default in defaults.items()
        if name != "grid" and getattr(args, name) != default
    ]


def grid_settings(args: argparse.Namespace) -> GridSettings:
    """The grid from parsed flags; raises ``ValueError`` naming a bad one."""
    try:
        routers = int_list(args.grid_routers)
        capacities = int_list(args.grid_capacities)
        loads = [float(x) for x in args.grid_loads.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            "--grid-routers, --grid-capacities and --grid-loads take comma-separated numbers"
        ) from None
    variants = [parse_variant(v) for v in args.grid_variants or []]
    g = GridSettings(
        base=settings_of(args),
        routers=routers,
        capacities=capacities,
        loads=loads,
        families=[f.strip() for f in args.grid_families.split(",") if f.strip()],
        requests=args.grid_requests or None,
        policies=[p.strip() for p in args.policies.split(",") if p.strip()],
        variants=variants,
    )
    g.check()
    return g


def _refusal(args: argparse.Namespace) -> str | None:
    """What ``--grid`` does not combine with, or None."""
    if args.trace is not None or args.limit is not None:
        return "--grid replays its own traces: use --grid-families and --grid-requests"
    if args.load is not None or args.speed != 1.0:
        return "--grid sets the load per cell: use --grid-loads"
    if args.grid_jobs < 1:
        return "--grid-jobs must be >= 1"
    if args.herding or args.follower or args.outage or args.indexer or args.plot_path:
        return (
            "--grid runs in process: not with --herding, --follower, --outage, "
            "--indexer or --plot (use --png)"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh replay``: the grid with ``--grid``, else the replay."""
    p = build_parser()
    add_arguments(p)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.grid:
        given = _grid_flags_given(args)
        if given:
            print(f"kvmesh replay: {', '.join(given)} need --grid", file=sys.stderr)
            return 2
        return run_args(args)
    problem = _refusal(args) or check_args(args)
    if problem is None:
        try:
            g = grid_settings(args)
        except ValueError as e:
            problem = str(e)
    if problem is not None:
        print(f"kvmesh replay: {problem}", file=sys.stderr)
        return 2
    if args.png_path and not plotting_available():
        print(
            "kvmesh replay: --png needs matplotlib, which is not installed: heat maps "
            "skipped (pip install 'kvmesh[replay]')",
            file=sys.stderr,
        )
        args.png_path = None
    try:
        grid = run_grid(g, args.grid_jobs)
    except ValueError as e:
        print(f"kvmesh replay: {e}", file=sys.stderr)
        return 2
    print(format_grid(grid))
    if args.json_path:
        write_report(args.json_path, grid.figures(), grid.params())
    if args.png_path:
        for out in plot_grid(grid, args.png_path):
            print(f"heat map: {out}")
    return 0
