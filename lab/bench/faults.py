"""``kvmesh bench faults``: the fault harness (lab/faults/) for a while, on every backend.

Rounds of seeded operations (``lab/faults/driver.py``) run one after another
until ``--duration`` seconds have passed: on 3 replicas (``--replicas``) over
a private ``redis-server``, on 3 replicas over a private 3-master Redis
Cluster with one replica per master, and on one memory-backend replica,
rotating over the operation profiles of ``lab/faults/ops.py`` (each isolates
a family of operations or a fault kind; ``all`` mixes them). Round ``k``
runs seed ``--seed + k``. A round stops at its first violation of the
contract (indexer/CONSISTENCY.md); the violation is then shrunk (deleting
operations while the same invariant still fails, at most ``--shrink-budget``
seconds) and printed with the command that replays it.

Printed: one row per (target, profile) with rounds, operations, faults and
violations, then every violation with its minimal sequence. ``--json FILE``
writes ``{"figures": {"operations", "faults_injected", "fault_kinds",
"replicas", "violations", ...}, "params": {...}, "violations": [...]}``.

``--follower`` adds a router's follower (router_client/follower.py) to every
round: it follows the replica (over Redis or a Cluster, replica 0's copy of
the shared index) over a real WatchIndex stream that the harness
cuts and stalls, and its Matches are checked against the
model under the follower's lag bound (lab/faults/fleet.py); the figures then
count its answers (``follower``: checked, fallback while out of sync, behind
while stalled; snapshots, resyncs, reconnects).

``--keep I,J,...`` (with ``--target``, ``--profile``, ``--seed``,
``--replicas``, ``--follower``) replays exactly the operations of that round with those
indices, as a shrunk violation prints them. The exit code is 1 when a
violation was found.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from kvmesh import progress
from kvmesh.clihelp import HelpFormatter
from kvmesh.runtime import new_event_loop
from lab.bench.report import table, write_report
from lab.faults.driver import (
    CALL_TIMEOUT_S,
    LAG_MARGIN_S,
    RECOVERY_S,
    RoundResult,
    RunParams,
    format_round,
    replay_line,
    run_round,
    shrink,
)
from lab.faults.faults import ClusterTarget, StandaloneTarget, Target
from lab.faults.fleet import CACHE_TTL_S, FOLLOWER_LAG_S, SOCKET_TIMEOUT_S
from lab.faults.ops import PROFILES, describe, profile_ops
from lab.redisproc import RedisClusterProcess, RedisProcess

#: Profiles each target rotates over (``all`` first: it mixes every family).
#: ``starve`` only on the memory backend, where a backlog is ingested without
#: a network wait; on Redis its bursts take seconds and prove little more.
ROTATION: dict[str, tuple[str, ...]] = {
    "standalone": (
        "all", "core", "leases", "bigseq", "pause", "restart", "deadline", "replica",
        "sglang", "zmq", "zmq_stale", "names",
    ),
    "cluster": (
        "all", "core", "leases", "bigseq", "pause", "deadline", "replica", "migrate",
        "failover", "sglang",
    ),
    "memory": ("all", "core", "leases", "replica", "sglang", "zmq", "zmq_stale", "starve", "names"),
}  # fmt: skip

#: Operations per round: long enough for faults to meet state worth losing,
#: short enough that a violation's round shrinks within its budget.
ROUND_OPS = 400


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``kvmesh bench faults``."""
    ap = argparse.ArgumentParser(
        prog="kvmesh bench faults",
        description="Seeded, model-checked fault injection on indexer replicas "
        "(Redis, Redis Cluster with replicas, memory).",
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of rounds")
    ap.add_argument("--json", dest="json_path", help="also write figures and params here")
    ap.add_argument("--seed", type=int, default=1, help="seed of the first round")
    ap.add_argument("--replicas", type=int, default=3, help="indexer replicas per Redis")
    ap.add_argument(
        "--targets", default="standalone,cluster,memory",
        help="comma-separated: standalone, cluster, memory",
    )  # fmt: skip
    ap.add_argument(
        "--follower",
        action="store_true",
        help="every round also follows a replica (over Redis: its copy of the index) with a "
        "router's follower and checks it",
    )
    ap.add_argument("--profiles", default="", help="comma-separated profiles (default: rotation)")
    ap.add_argument("--ops", type=int, default=ROUND_OPS, help="operations per round")
    ap.add_argument(
        "--shrink-budget", type=float, default=60.0, help="seconds to shrink each violation"
    )
    ap.add_argument("--target", default="", help="replay: the round's target (default: no replay)")
    ap.add_argument("--profile", default="all", help="replay: the round's profile")
    ap.add_argument(
        "--keep",
        default="",
        help="replay: indices of the operations to run, e.g. 3,7,10..14 (default: all)",
    )
    return ap


@contextlib.contextmanager
def _targets(kinds: Sequence[str]) -> Iterator[dict[str, Target]]:
    procs: list[Any] = []
    out: dict[str, Target] = {}
    try:
        for k in kinds:
            if k == "standalone":
                p = RedisProcess().start()
                procs.append(p)
                out[k] = StandaloneTarget(p)
            elif k == "cluster":
                c = RedisClusterProcess(replicas=1).start()
                procs.append(c)
                out[k] = ClusterTarget(c)
            elif k == "memory":
                out[k] = Target()
            else:
                raise SystemExit(f"kvmesh bench faults: unknown target {k!r}")
        yield out
    finally:
        for p in procs:
            p.close()


def _quiet() -> None:
    # Gaps, lost batches and retries are what the harness causes on purpose.
    logging.basicConfig(level=logging.ERROR)
    for name in ("indexer", "kvmesh", "lab", "grpc"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")


def _runs_on(profile: str, kind: str) -> bool:
    """Whether ``profile`` means something on target ``kind`` (not only the core mix)."""
    ops = profile_ops(profile, kind)
    dropped = set(PROFILES[profile].weights) - set(ops)
    return not (dropped and ops == profile_ops("core", kind))


async def _run(
    args: argparse.Namespace, targets: dict[str, Target]
) -> tuple[list[RoundResult], dict[int, RoundResult]]:
    """Rounds until the duration is spent; and, by round index, each violation shrunk."""
    kinds = list(targets)
    chosen = [p for p in args.profiles.split(",") if p]
    turn: Counter[str] = Counter()
    rounds: list[RoundResult] = []
    shrunk: dict[int, RoundResult] = {}
    start = time.monotonic()
    k = 0
    while time.monotonic() - start < args.duration:
        kind = kinds[k % len(kinds)]
        # A profile whose fault the target cannot take would only rerun the core mix.
        rotation = [p for p in (chosen or ROTATION[kind]) if _runs_on(p, kind)]
        if not rotation:
            kinds.remove(kind)
            if not kinds:
                break
            continue
        profile = rotation[turn[kind] % len(rotation)]
        turn[kind] += 1
        left = args.duration - (time.monotonic() - start)
        p = RunParams(
            seed=args.seed + k,
            profile=profile,
            replicas=args.replicas,
            ops=args.ops,
            duration_s=max(left, 1.0),
            follower=args.follower,
        )
        progress.phase(f"round {k}: {kind}/{profile}, seed {p.seed}")
        res = await run_round(targets[kind], p)
        status = str(res.violations[0]) if res.violations else "ok"
        print(
            f"round {k}: {kind}/{profile} seed {p.seed}: {res.operations} ops, "
            f"{sum(res.faults.values())} faults, {res.elapsed_s:.1f}s"
            + (f", follower {dict(res.follower)}" if res.follower else "")
            + f": {status[:160]}",
            flush=True,
        )
        if res.violations:
            small = await shrink(targets[kind], res, args.shrink_budget)
            shrunk[k] = small if small.violations else res
            print(format_round(shrunk[k]), flush=True)
        rounds.append(res)
        k += 1
    return rounds, shrunk


def _figures(rounds: Sequence[RoundResult], replicas: int) -> dict[str, Any]:
    kinds: Counter[str] = Counter()
    by_inv: Counter[str] = Counter()
    by_target: Counter[str] = Counter()
    follower: Counter[str] = Counter()
    for r in rounds:
        kinds.update(r.faults)
        follower.update(r.follower)
        by_target[r.target] += r.operations
        if r.violations:
            by_inv[r.violations[0].invariant] += 1
    return {
        "operations": sum(r.operations for r in rounds),
        "faults_injected": sum(kinds.values()),
        "fault_kinds": dict(sorted(kinds.items())),
        "replicas": replicas,
        "violations": sum(1 for r in rounds if r.violations),
        "violations_by_invariant": dict(sorted(by_inv.items())),
        "rounds": len(rounds),
        "operations_by_target": dict(sorted(by_target.items())),
        **({"follower": dict(sorted(follower.items()))} if follower else {}),
    }


def _table(rounds: Sequence[RoundResult]) -> str:
    rows: dict[tuple[str, str], list[int]] = {}
    for r in rounds:
        row = rows.setdefault((r.target, r.params.profile), [0, 0, 0, 0])
        row[0] += 1
        row[1] += r.operations
        row[2] += sum(r.faults.values())
        row[3] += bool(r.violations)
    head = (
        f"{'target':<11} {'profile':<10} {'rounds':>6} {'ops':>8} {'faults':>7} {'violations':>10}"
    )
    lines = [
        f"{t:<11} {p:<10} {v[0]:>6} {v[1]:>8,} {v[2]:>7,} {v[3]:>10}"
        for (t, p), v in sorted(rows.items())
    ]
    return table(head, lines)


def _violation_doc(r: RoundResult) -> dict[str, Any]:
    """A (shrunk) violating round as the report lists it."""
    v = r.violations[0]
    return {
        "target": r.target,
        "profile": r.params.profile,
        "seed": r.params.seed,
        "invariant": v.invariant,
        "step": v.step,
        "detail": v.detail,
        "replay": replay_line(r),
        "operations": [f"[{i}] {describe(op)}" for i, op in r.ran],
    }


def _parse_keep(text: str) -> tuple[int, ...]:
    """``--keep`` as indices: ``3,7,10..14`` (a range ``A..B`` includes both ends)."""
    out: list[int] = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("..")
        try:
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
        except ValueError:
            raise SystemExit(f"kvmesh bench faults: --keep: {part!r} is not N or A..B") from None
    return tuple(out)


def _replay(args: argparse.Namespace) -> int:
    keep = _parse_keep(args.keep)
    with _targets([args.target]) as targets:
        p = RunParams(
            seed=args.seed, profile=args.profile, replicas=args.replicas, ops=max(keep) + 1,
            keep=keep, follower=args.follower,
        )  # fmt: skip
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            res = runner.run(run_round(targets[args.target], p))
    if res.violations:
        print(format_round(res))
        return 1
    print(f"{res.operations} operations, no violation")
    return 0


def main(argv: Sequence[str]) -> int:
    """Run ``kvmesh bench faults``; exit code 1 when a violation was found."""
    args = build_parser().parse_args(list(argv))
    _quiet()
    if args.keep:
        if not args.target:
            raise SystemExit("kvmesh bench faults: --keep needs --target (and --profile, --seed)")
        return _replay(args)
    kinds = [k for k in args.targets.split(",") if k]
    with _targets(kinds) as targets, asyncio.Runner(loop_factory=new_event_loop) as runner:
        rounds, shrunk = runner.run(_run(args, targets))
    print()
    print(_table(rounds))
    figures = _figures(rounds, args.replicas)
    print("figures:", json.dumps(figures))
    if args.json_path:
        params = {
            "duration_s": args.duration,
            "seed": args.seed,
            "targets": kinds,
            "profiles": args.profiles.split(",") if args.profiles else ROTATION,
            "round_ops": args.ops,
            "instance_cache_ttl_s": CACHE_TTL_S,
            "socket_timeout_s": SOCKET_TIMEOUT_S,
            "lag_margin_s": LAG_MARGIN_S,
            "recovery_s": RECOVERY_S,
            "call_timeout_s": CALL_TIMEOUT_S,
            "follower": args.follower,
            "follower_lag_s": FOLLOWER_LAG_S,
            "cluster": "3 masters, 1 replica each",
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        }
        write_report(
            args.json_path,
            figures,
            params,
            violations=[_violation_doc(shrunk[k]) for k in sorted(shrunk)],
        )
    return 1 if figures["violations"] else 0
