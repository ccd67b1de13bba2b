"""``kvmesh replay --grid``: a tiny grid runs, its verdicts follow from its figures, and
variants take any ReplaySettings field by name and refuse unknown ones."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvmesh.cli import main as kvmesh_main
from lab.sim.grid import (
    GridSettings,
    judge,
    parse_variant,
    run_grid,
)
from lab.sim.replay import POLICIES, ReplaySettings

BASE = ReplaySettings(workers=4, seed=1, cost_model="blocks")


def _expected(figures: dict[str, float], cell: str, subject: str, load: float) -> dict[str, bool]:
    """The targets recomputed from ``--json`` figures alone."""

    def f(policy: str, name: str) -> float:
        return figures[f"{cell}_{policy}_{name}"]

    others = [p for p in POLICIES if p != "cache_shared"]
    p95 = f(subject, "ttft_p95_ms")
    ratio = p95 / f("p2c", "ttft_p95_ms")
    lowest = all(p95 <= f(o, "ttft_p95_ms") for o in others)
    best = all(f(subject, "goodput") >= f(o, "goodput") for o in others)
    cv = f(subject, "worker_cv") / f("p2c", "worker_cv")
    out = {"target_b": f(subject, "bound_fraction") >= 0.95 and cv <= 1.2}
    if load >= 0.7:
        out["target_a"] = ratio <= 0.6 and lowest and best
    return out


def test_a_tiny_grid_judges_every_cell_from_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js, png = tmp_path / "grid.json", tmp_path / "grid.png"
    rc = kvmesh_main(
        [
            "replay",
            "--grid",
            "--cost",
            "blocks",
            "--workers",
            "4",
            "--grid-families",
            "chat",
            "--grid-routers",
            "2",
            "--grid-capacities",
            "100",
            "--grid-loads",
            "0.5,0.9",
            "--grid-requests",
            "300",
            "--grid-variants",
            "bal0.5:balance=0.5,service.max_running=8",
            "--json",
            str(js),
            "--png",
            str(png),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "cache_shared[bal0.5]" in out and "p95/p2c" in out and "2 cells in" in out
    doc = json.loads(js.read_text())
    figures, params = doc["figures"], doc["params"]
    assert params["variants"] == {"bal0.5": {"balance": 0.5, "service.max_running": 8}}
    assert params["requests"] == {"chat": 300}
    for load in (0.5, 0.9):
        cell = f"chat_R2_C100_L{load:g}"
        for subject in ("cache_shared", "cache_shared[bal0.5]"):
            want = _expected(figures, cell, subject, load)
            got = {
                k: figures[f"{cell}_{subject}_{k}"] == 1.0
                for k in ("target_a", "target_b")
                if f"{cell}_{subject}_{k}" in figures
            }
            assert got == want, (cell, subject)
    # the variant really ran with its settings: a different balance, other hits
    assert (
        figures["chat_R2_C100_L0.9_cache_shared[bal0.5]_hit_rate"]
        != figures["chat_R2_C100_L0.9_cache_shared_hit_rate"]
    )
    assert figures["cache_shared_target_a_cells"] == 1  # load 0.9 only
    assert figures["cache_shared_target_b_cells"] == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "grid-bal0.5.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_verdict_follows_the_thresholds() -> None:
    figs = {}
    for p, p95, goodput, cv in (
        ("p2c", 10_000.0, 0.5, 0.10),
        ("random", 12_000.0, 0.4, 0.10),
        ("cache_shared", 5_900.0, 0.8, 0.12),
    ):
        figs |= {f"{p}_ttft_p95_ms": p95, f"{p}_goodput": goodput, f"{p}_worker_cv": cv}
    figs["cache_shared_bound_fraction"] = 0.95
    v = judge(figs, "cache_shared", ["p2c", "random"], 0.7)
    assert v.target_a and v.target_b and v.ttft_p95_ratio == pytest.approx(0.59)
    assert judge(figs, "cache_shared", ["p2c", "random"], 0.5).target_a is None
    figs["cache_shared_ttft_p95_ms"] = 6_100.0  # 0.61x: fails (a)
    figs["cache_shared_worker_cv"] = 0.13  # 1.3x: fails (b)
    v = judge(figs, "cache_shared", ["p2c", "random"], 0.9)
    assert v.target_a is False and v.target_b is False and v.lowest_ttft_p95


def test_run_grid_in_two_processes_matches_one() -> None:
    g = GridSettings(
        base=BASE,
        routers=[2],
        capacities=[50, 100],
        loads=[0.7],
        families=["rag"],
        requests=200,
        policies=["p2c", "cache_shared"],
    )
    one, two = run_grid(g), run_grid(g, jobs=2)
    assert [c.verdicts for c in one.cells] == [c.verdicts for c in two.cells]
    assert [c.capacity for c in two.cells] == [50, 100]


def test_a_variant_takes_any_settings_field_and_names_a_bad_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ReplaySettings()
    for f in dataclasses.fields(ReplaySettings):  # every plain field, as text
        value = getattr(base, f.name)
        if isinstance(value, bool | int | float | str):
            v = parse_variant(f"x:{f.name}={value}")
            assert getattr(v.apply(base), f.name) == value, f.name
    v = parse_variant("m:service.max_running=16,load_view=local,indexer=none")
    s = v.apply(base)
    assert (s.service.max_running, s.load_view, s.indexer) == (16, "local", None)
    assert s.service.prefill_tokens_per_s == base.service.prefill_tokens_per_s
    for text, named in (
        ("x:no_such_field=1", "no_such_field"),
        ("x:service.nope=1", "nope"),
        ("x:load_view=sideways", "load_view"),
        ("x:routers=many", "routers"),
    ):
        with pytest.raises(ValueError, match=named):
            parse_variant(text)
    rc = kvmesh_main(["replay", "--grid", "--grid-variants", "bad:no_such_field=1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no_such_field" in err and "ReplaySettings" in err
    assert kvmesh_main(["replay", "--grid-loads", "0.5"]) == 2  # grid flags need --grid
    assert "--grid-loads need --grid" in capsys.readouterr().err
    assert kvmesh_main(["replay", "--grid", "--grid-families", "nope"]) == 2
