"""``kvmesh bench conformance``: kvmesh's Match against real engines' own prefix caches.

Each vLLM scenario (``lab/conformance.py``: ``full``, ``fanout``, ``swa``,
``mamba``, ``mamba64``, ``lora``, ``salt``, ``mm``, ``multi``; ``full`` is also
measured with ``keys: engine_hashes`` as ``full_engine_hashes``) runs real
vLLM engines (``lab/engines/vllm_engine.py``, in the vLLM virtualenv that
``make setup`` creates), each SGLang scenario (``lab/conformance_sglang.py``:
``sglang_full``, ``sglang_page1``, ``sglang_lora``, ``sglang_salt``,
``sglang_multi``, ``sglang_swa``, ``sglang_mamba``, rows ``<scenario>`` for
``keys: tokens`` and ``<scenario>_engine_hashes``) real SGLang engines
(``lab/engines/sglang_engine.py``, in ``.venv-sglang``), against indexers on
the chosen backends, and every request's predicted reuse is compared with the
engine's. ``--engine`` picks whose scenarios run (both by default). It
measures; a figure below 100 % is the indexer's, not the harness's.

Printed: one row per (scenario, backend) with requests compared, hits (vLLM
or kvmesh saw a reusable prefix; the other requests agree trivially), exact, over
(kvmesh promised more than vLLM reuses), under, the exact fraction and the
batches the indexer rejected; then the first mismatches of each row that has
any. ``--json FILE`` writes ``{"figures": {"conf_<row>_exact_fraction",
"conf_<row>_over", "conf_<row>_under", ...}, "params": {...}, "rows": [...]}``;
with ``--backend both`` every figure name carries its backend
(``conf_<row>_<backend>_exact_fraction``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvmesh import progress
from kvmesh.clihelp import HelpFormatter
from lab.bench.report import table, write_report
from lab.conformance import (
    BACKENDS,
    DEFAULT_REQUESTS,
    FOLLOWS,
    VLLM,
    EngineKind,
    EngineMissing,
    Result,
    RunResult,
    run_scenario,
)
from lab.conformance_sglang import SGLANG
from lab.redisproc import RedisProcess

#: The engines by their ``--engine`` name.
ENGINES: dict[str, EngineKind] = {"vllm": VLLM, "sglang": SGLANG}


def engine_of(scenario: str) -> EngineKind | None:
    """The engine whose scenario this is (scenario names are unique across engines)."""
    return next((kind for kind in ENGINES.values() if scenario in kind.specs), None)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``kvmesh bench conformance``."""
    every = [s for kind in ENGINES.values() for s in kind.specs]
    ap = argparse.ArgumentParser(
        prog="kvmesh bench conformance",
        description="kvmesh's Match against vLLM 0.33's KVCacheManager.get_computed_blocks "
        "and SGLang 0.5.23's UnifiedRadixCache.match_prefix, request by request (each "
        "engine runs from its own virtualenv: make setup).",
        formatter_class=HelpFormatter,
    )
    ap.add_argument(
        "--engine",
        choices=(*ENGINES, "both"),
        default="both",
        help="whose scenarios run when --scenarios names none",
    )
    ap.add_argument(
        "--scenarios",
        default="",
        help=f"comma-separated, of {', '.join(every)} (default: every scenario of --engine)",
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=DEFAULT_REQUESTS,
        help="requests per scenario",
    )
    ap.add_argument(
        "--backend",
        choices=(*BACKENDS, "both"),
        default="memory",
        help="indexer backend; follower / redis_follower: a router's follower of the memory / "
        "Redis indexer (which runs too); both: every backend against the same engines",
    )
    ap.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="tokens per block (vLLM) or page (SGLang) of engine and indexer (default: 0, "
        "the scenario's: 16, vLLM's Mamba scenarios 64, SGLang's page1 and mamba 1)",
    )
    ap.add_argument("--seed", type=int, default=1, help="workload seed")
    ap.add_argument("--json", dest="json_path", help="also write figures and params here")
    ap.add_argument("--logs", metavar="DIR", help="keep the engines' and indexers' logs here")
    ap.add_argument("--examples", type=int, default=3, help="mismatches printed per row")
    return ap


@contextlib.contextmanager
def _redis(needed: bool) -> Iterator[str]:
    if not needed:
        yield ""
        return
    with RedisProcess() as proc:
        yield proc.url


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_table(results: Sequence[Result]) -> str:
    """The conformance table (one row per scenario and backend)."""
    w = max([20, *(len(r.row) for r in results)])
    head = (
        f"{'scenario':<{w}} {'backend':<7} {'requests':>8} {'hits':>6} {'exact':>7} {'over':>6} "
        f"{'under':>6} {'exact %':>8} {'rejected':>8}"
    )
    rows = [
        f"{r.row:<{w}} {r.backend:<7} {r.requests:>8,} {r.hits:>6,} {r.exact:>7,} {r.over:>6,} "
        f"{r.under:>6,} {_pct(r.exact_fraction):>8} {r.rejected_batches:>8,}"
        for r in results
    ]
    return table(head, rows)


def figures_of(results: Sequence[Result], *, with_backend: bool) -> dict[str, Any]:
    """``conf_<row>[_<backend>]_{exact_fraction,over,under,requests}`` per result."""
    out: dict[str, Any] = {}
    for r in results:
        name = f"conf_{r.row}_{r.backend}" if with_backend else f"conf_{r.row}"
        out[f"{name}_exact_fraction"] = round(r.exact_fraction, 6)
        out[f"{name}_over"] = r.over
        out[f"{name}_under"] = r.under
        out[f"{name}_requests"] = r.requests
    return out


def _engine_note(run: RunResult) -> str:
    """What the engines did, in one line: the shape behind the figures."""
    keys = ("lookups", "preemptions", "resets", "batches")
    totals = {k: sum(int(e.get(k, 0)) for e in run.engines) for k in keys}
    events: dict[str, int] = {}
    for e in run.engines:
        for name, n in (e.get("events") or {}).items():
            events[name] = events.get(name, 0) + int(n)
    hits = sum(int(e.get("hit_tokens", 0)) for e in run.engines)
    looked = sum(int(e.get("lookup_tokens", 0)) for e in run.engines) or 1
    ev = ", ".join(f"{k} {v:,}" for k, v in sorted(events.items()) if not k.endswith("_blocks"))
    engine = engine_of(run.spec.scenario)
    kind = engine.name if engine is not None else "engine"
    return (
        f"  {run.spec.scenario}: {totals['lookups']:,} lookups, {kind} hit rate "
        f"{_pct(hits / looked)}, {totals['preemptions']} preemptions, {totals['resets']} "
        f"resets, {totals['batches']:,} batches ({ev}); {run.seconds:.0f} s"
    )


def main(argv: Sequence[str]) -> int:
    """Run ``kvmesh bench conformance``; exit code 2 when an engine's virtualenv is missing."""
    args = build_parser().parse_args(list(argv))
    names = [s for s in args.scenarios.split(",") if s]
    if not names:
        kinds = list(ENGINES.values()) if args.engine == "both" else [ENGINES[args.engine]]
        names = [s for kind in kinds for s in kind.specs]
    unknown = [s for s in names if engine_of(s) is None]
    if unknown:
        raise SystemExit(f"kvmesh bench conformance: unknown scenarios {unknown}")
    if args.backend == "both":
        backends = list(BACKENDS)
    elif args.backend in FOLLOWS:
        backends = [FOLLOWS[args.backend], args.backend]  # a follower needs its indexer
    else:
        backends = [args.backend]
    pythons: dict[str, Path] = {}
    for name in names:
        kind = engine_of(name)
        assert kind is not None
        if kind.name in pythons:
            continue
        try:
            pythons[kind.name] = kind.python()
        except EngineMissing as e:
            print(f"kvmesh bench conformance: {e}", file=sys.stderr)
            return 2
    results: list[Result] = []
    runs: list[RunResult] = []
    logs = Path(args.logs) if args.logs else None
    with _redis("redis" in backends) as redis_url:
        for name in names:
            kind = engine_of(name)
            assert kind is not None
            progress.phase(f"{name}: {args.requests:,} requests")
            run = run_scenario(
                name,
                requests=args.requests,
                backends=backends,
                redis_url=redis_url,
                seed=args.seed,
                python=pythons[kind.name],
                log_dir=logs,
                block_size=args.block_size,
                engine=kind,
            )
            runs.append(run)
            results += run.results()
            print(f"{name}: done in {run.seconds:.0f} s", file=sys.stderr, flush=True)
    print(format_table(results))
    print("engines:")
    for run in runs:
        print(_engine_note(run))
    for r in results:
        for ex in r.examples[: args.examples]:
            print(f"  {r.row}/{r.backend} {ex['verdict']}: {json.dumps(ex)}")
    if args.json_path:
        params: dict[str, Any] = {
            "scenarios": names,
            "requests": args.requests,
            "backends": backends,
            "seed": args.seed,
            "block_size": args.block_size or "per scenario",
        }
        for kind in ENGINES.values():
            shapes = [
                r.engines[0].get("shape", {})
                for r in runs
                if r.engines and engine_of(r.spec.scenario) is kind
            ]
            if shapes:
                key = kind.name.lower()  # READY names the engine's version so
                params[key] = shapes[0].get(key, "")
                params[f"{key}_python"] = str(pythons[kind.name])
        params |= {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        }
        write_report(
            args.json_path,
            figures_of(results, with_backend=len(backends) > 1),
            params,
            rows=[r.as_dict() for r in results],
            engines={run.spec.scenario: run.engines for run in runs},
        )
    return 0
