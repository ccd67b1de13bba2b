"""kvmesh's Match against SGLang 0.5.23's real radix cache (``UnifiedRadixCache``).

Every scenario of ``lab/conformance_sglang.py`` runs real SGLang engines (from
the SGLang virtualenv ``make setup`` creates) against a memory and a Redis
indexer at once, :data:`REQUESTS` requests each (``keys: engine_hashes``, row
``<scenario>_engine_hashes``, and for the single-engine full-attention
scenarios also ``keys: tokens``, row ``<scenario>``), and every admitted
request's predicted reuse is compared with the ``device_prefix_len`` of
SGLang's own match. A row passes with at least :data:`MIN_EXACT` of its
requests exact and none over.

A row kvmesh gets wrong today is a strict xfail naming its measured figure
and cause: when a fix makes it pass, the xfail fails the run and its mark must
go. Only a failed comparison is an expected failure; a harness that cannot run
(no SGLang, a child that died, a timeout) fails as usual. Nothing here skips:
without the SGLang interpreter every test fails, saying to run ``make setup``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.conformance import (
    BACKENDS,
    Observation,
    Result,
    RunResult,
    ScenarioRuns,
    classify,
    predicted_tokens,
    row_name,
    summarize,
)
from lab.conformance_sglang import (
    SGLANG,
    SGLANG_PYTHON_ENV,
    SPECS,
    SglangMissing,
    sglang_python,
)

#: Requests per scenario: enough for eviction, flushes and shared prefixes to
#: occur (the SWA and Mamba rows fail at it as at 2,000), few enough for the
#: whole file to take about a minute on two cores, the engines forked from one
#: zygote (two with ``KVMESH_CONFORMANCE_ZYGOTE=0``; ``kvmesh bench conformance
#: --engine sglang`` runs 2,000).
REQUESTS = 150
MIN_EXACT = 0.995
#: Runs at a time. A run is mostly latency (the lockstep round trip through
#: ZMQ, the indexer and Match), so three overlap on two cores without one
#: starving another.
JOBS = 3

_SWA = (
    "SGLang publishes no event for its SWA component: a node whose sliding-window KV was "
    "freed (out of the window at insert, by free_out_of_window_slots, or evicted from the "
    "SWA LRU under pool pressure) keeps its full-attention KV and its BlockStored, and "
    "match_prefix stops where the last window before the hit has no SWA value; the index "
    "sees only full-attention blocks, so it promises them (e.g. 400 tokens where SGLang "
    "reuses 32, or the 32-token system prompt where it reuses 0). With an SWA pool as large "
    "as the full one 4 over remain: the out-of-window frees alone"
)
_MAMBA = (
    "SGLang publishes no event for its Mamba component: without the extra buffer a Mamba "
    "state exists only where an insert ended (a prefill, a chunk, a finished sequence), and "
    "states are evicted from the Mamba LRU (24 slots) silently, while match_prefix stops at "
    "the deepest node holding one; the index sees every full-attention block, so it promises "
    "shared prefixes (the system prompt, a parent turn) no Mamba state ends at. With 512 "
    "slots (no state evicted) 258 over remain: where states exist at all is the cause"
)
#: Row -> why it fails today (both backends measure the same), with the
#: figures measured at REQUESTS and, in brackets, by ``kvmesh bench
#: conformance --engine sglang`` at 2,000 requests.
FAILING: dict[str, str] = {
    "sglang_swa_engine_hashes": f"96.6% exact, 6 over, 0 under (2,000: 95.8%, 86 over): {_SWA}",
    "sglang_mamba_engine_hashes": (
        f"14.5% exact, 153 over, 0 under (2,000: 13.9%, 1,776 over): {_MAMBA}"
    ),
}
XFAIL: dict[tuple[str, str], str] = {
    (row, backend): reason for row, reason in FAILING.items() for backend in BACKENDS
}

ROWS = [(row_name(s.scenario, k), s.scenario) for s in SPECS.values() for k in s.keys]
CASES = [
    pytest.param(
        row,
        scenario,
        backend,
        id=f"{row}-{backend}",
        marks=[pytest.mark.xfail(strict=True, raises=AssertionError, reason=XFAIL[(row, backend)])]
        if (row, backend) in XFAIL
        else [],
    )
    for row, scenario in ROWS
    for backend in BACKENDS
]


class Runs:
    """The session's scenario runs, started on first use; without SGLang, each use fails."""

    def __init__(self, request: pytest.FixtureRequest, redis_url: str) -> None:
        self._request = request
        self._redis_url = redis_url
        self._pool: ScenarioRuns | None = None
        self._missing = ""

    def get(self, scenario: str) -> RunResult:
        if self._pool is None and not self._missing:
            try:
                python = sglang_python()
            except SglangMissing as e:
                self._missing = str(e)
            else:
                self._pool = ScenarioRuns(
                    self._wanted(),
                    jobs=JOBS,
                    requests=REQUESTS,
                    backends=BACKENDS,
                    redis_url=self._redis_url,
                    python=python,
                    engine=SGLANG,
                )
        if self._missing:
            pytest.fail(self._missing, pytrace=False)
        assert self._pool is not None
        return self._pool.get(scenario)

    def _wanted(self) -> list[str]:
        """The SGLang scenarios of the selected tests, slowest first (JOBS run at a
        time), ``sglang_full`` always: the broken-comparison test reads it."""
        wanted: set[str] = {"sglang_full"}
        for item in self._request.session.items:
            spec = getattr(item, "callspec", None)
            scenario = spec.params.get("scenario") if spec is not None else None
            if isinstance(scenario, str) and scenario in SPECS:
                wanted.add(scenario)
        return [s for s in _SLOWEST_FIRST if s in wanted]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


#: Scenarios by how long they take (three engines, then 1-token pages): the
#: longest start first, so the two runs at a time end close together.
_SLOWEST_FIRST = sorted(
    SPECS,
    key=lambda s: (-SPECS[s].engines, SPECS[s].block_size, list(SPECS).index(s)),
)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, redis_server: Any) -> Iterator[Runs]:
    """Every scenario the session selected, JOBS runs at a time, both backends per engine."""
    r = Runs(request, redis_server.url)
    try:
        yield r
    finally:
        r.close()


def _result(run: RunResult, row: str, backend: str, skew_blocks: int = 0) -> Result:
    return next(r for r in run.results(skew_blocks) if r.row == row and r.backend == backend)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("row", "scenario", "backend"), CASES)
def test_match_agrees_with_sglang(runs: Runs, row: str, scenario: str, backend: str) -> None:
    r = _result(runs.get(scenario), row, backend)
    assert r.requests >= REQUESTS
    verdict = (
        f"{row}/{backend}: {r.exact}/{r.requests} exact ({r.exact_fraction:.1%}), "
        f"{r.over} over, {r.under} under, {r.rejected_batches} batches rejected; "
        f"first mismatches: {r.examples}"
    )
    assert r.over == 0, verdict
    assert r.exact_fraction >= MIN_EXACT, verdict


@pytest.mark.timeout(900)
def test_the_harness_flags_an_answer_one_page_too_deep(runs: Runs) -> None:
    """The same observations, compared as if kvmesh had answered one page deeper."""
    run = runs.get("sglang_full")
    row = "sglang_full_engine_hashes"
    honest = _result(run, row, "memory")
    broken = _result(run, row, "memory", skew_blocks=1)
    assert honest.exact_fraction >= MIN_EXACT and honest.over == 0
    assert broken.over > 0 and broken.exact_fraction < MIN_EXACT, broken.as_dict()
    # Every request whose prompt has room for one more page became over.
    roomy = [
        ob
        for ob in run.observations[(row, "memory")]
        if ob.predicted() < (ob.n_tokens - 1) // ob.block_size * ob.block_size
        and ob.predicted() == ob.truth
    ]
    assert broken.over >= len(roomy) > 0


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("scenario", "components", "counters"),
    [
        ("sglang_full", ["FULL"], ("removed_blocks", "cleared")),
        ("sglang_page1", ["FULL"], ("removed_blocks",)),
        ("sglang_lora", ["FULL"], ("stored_lora", "removed_blocks")),
        ("sglang_salt", ["FULL"], ("stored_salted", "removed_blocks")),
        ("sglang_multi", ["FULL"], ("removed_blocks",)),
        ("sglang_swa", ["FULL", "SWA"], ("removed_blocks",)),
        ("sglang_mamba", ["FULL", "MAMBA"], ("removed_blocks",)),
    ],
)
def test_each_scenario_runs_the_cache_it_names(
    runs: Runs, scenario: str, components: list[str], counters: tuple[str, ...]
) -> None:
    """The engines ran SGLang's UnifiedRadixCache with the scenario's components and
    page size, reused prefixes, and published what the scenario is about (evictions,
    flushes, LoRA names, salts): a row that agrees only because nothing happened
    would pass vacuously."""
    run = runs.get(scenario)
    spec = SPECS[scenario]
    assert len(run.engines) == spec.engines
    for engine in run.engines:
        shape = engine["shape"]
        assert shape["sglang"] == "0.5.23"
        assert shape["tree"] == "UnifiedRadixCache"
        assert shape["components"] == components
        assert shape["block_size"] == spec.block_size
        assert engine["hit_tokens"] > 0
        events = engine["events"]
        for name in counters:
            assert events.get(name, 0) > 0, (scenario, name, events)
    if scenario == "sglang_full":
        assert sum(e["resets"] for e in run.engines) > 0


def test_tokens_are_counted_the_way_sglang_counts_its_hit() -> None:
    # SGLang matches at most n - 1 tokens, in whole pages: a 48-token prompt at
    # 16-token pages reuses at most 32, and at 1-token pages at most 47.
    assert predicted_tokens(3, 16, 48) == 32
    assert predicted_tokens(3, 16, 49) == 48
    assert predicted_tokens(48, 1, 48) == 47
    assert predicted_tokens(30, 1, 48) == 30
    assert predicted_tokens(1, 1, 1) == 0
    assert [classify(p, 32) for p in (31, 32, 33)] == ["under", "exact", "over"]


def test_a_summary_at_one_token_pages_counts_every_verdict() -> None:
    obs = [
        Observation(f"r{i}", 100, truth, depth, 1, False, False, "", "", ())
        for i, (truth, depth) in enumerate([(99, 120), (40, 41), (40, 39), (0, 0)])
    ]
    r = summarize("sglang_page1", "memory", obs)
    assert (r.requests, r.exact, r.over, r.under) == (4, 2, 1, 1)
    assert [e["verdict"] for e in r.examples] == ["over", "under"]


def test_a_missing_sglang_interpreter_says_to_run_make_setup(tmp_path: Path) -> None:
    # The variable is given, not set: the scenario runs start engines on other
    # threads meanwhile, and this process's environment is theirs too.
    with pytest.raises(SglangMissing, match="make setup"):
        sglang_python({SGLANG_PYTHON_ENV: str(tmp_path / "no-such-python")})
