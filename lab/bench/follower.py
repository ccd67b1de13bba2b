"""``kvmesh bench follower``: a router's follower beside the indexer and Dynamo's in-process index.

The run: ``kvmesh indexer serve`` (memory backend, loopback, plaintext) in a
child process (``--backend redis``: two, over one private redis-server, every
write through the first and the follower on the second, which serves its copy
of the shared index: indexer/redis/KEYS.md "Watching") holds ``--holders``
instances (64), each holding the same prompts of 32 and 1,024 blocks (every
block has 64 holders: the costliest Match there is) plus a tail of its own.
A :class:`router_client.follower.IndexFollower` in this process follows it. Measured, in one run:

- ``follower_match_{32,1024}_p50_us`` / ``_p99_us``: the follower's Match
  (``IndexFollower.match``: the memory backend's ``match_sync`` on its copy),
  called back to back on the prompts' keys;
- ``dynamo_inproc_match_{32,1024}_p50_us`` / ``_p99_us``: Dynamo's
  ``RadixTree.find_matches`` (``ai-dynamo-runtime`` 1.6.1, its own
  interpreter) on the same blocks held by the same 64 workers, the same
  sequences, timed the same way in its process;
- ``remote_match_{32,1024}_p50_us``: the indexer's Match over gRPC (unary, by
  keys) for the same prompts: what the follower saves;
- ``follower_lag_p50_ms`` / ``_p99_ms``: while a publisher in a thread of
  this process streams ``--ingest-s`` seconds of batches as fast as the
  indexer acks them (PublishEventsStream, 8 in flight), each change's arrival
  at the follower minus the indexer's ``applied_at`` (one host, one clock;
  over Redis the writing replica's apply, so the lag is end to end),
  with ``ingest_blocks_per_s`` the rate the indexer applied;
- ``follower_bytes_per_block_instance``: the follower's RSS growth across
  its snapshot over the (block, instance) pairs it loaded;
- ``follower_wrong_answers``: after the ingest, Matches where the follower
  (caught up) and the indexer disagree (must be 0);
- ``follower_match_pred_{32,1024}_p50_us`` / ``_p99_us`` and
  ``remote_match_pred_{32,1024}_p50_us``: the same with predictions
  (``include_predicted``), 16 holders each predicted for the prompt's next
  turn (8 blocks more): the follower answers from the predictions its stream
  carries; ``follower_pred_wrong_answers``: its answers (predicted depths and
  the pending prefill) against the indexer's (must be 0).

Not measured here yet: routing quality through an indexer restart (replay
with ``--follower``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.blockkeys import block_keys
from kvmesh.clihelp import HelpFormatter
from kvmesh.stats import percentile
from lab.bench.peer_procs import dynamo_python
from lab.bench.report import fmt, table, write_report
from lab.children import ChildProcess
from lab.redisproc import RedisProcess, free_port
from router_client.follower import IndexFollower

HOST = "127.0.0.1"
MODEL = "follow/model"
BLOCK = 16
PROMPT_BLOCKS = (32, 1024)

#: Dynamo's side, run by its interpreter: the same chains, timed like ours.
_DYNAMO_SCRIPT = r"""
import json, sys, time
from dynamo._core import RadixTree
spec = json.load(sys.stdin)
t = RadixTree()
eid = 0
for w in range(spec["holders"]):
    for chain in spec["chains"]:
        eid += 1
        blocks = [{"block_hash": k, "tokens_hash": k} for k in chain]
        data = {"stored": {"parent_hash": None, "blocks": blocks}}
        t.apply_event(w, json.dumps({"event_id": eid, "data": data}).encode())
out = {}
for chain in spec["chains"]:
    r = t.find_matches(chain)
    assert len(r.scores) == spec["holders"], r.scores
    assert all(v == len(chain) for v in r.scores.values()), r.scores
    lat = []
    for _ in range(spec["calls"]):
        t0 = time.perf_counter()
        t.find_matches(chain)
        lat.append(time.perf_counter() - t0)
    lat.sort()
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    out[str(len(chain))] = [lat[len(lat) // 2] * 1e6, p99 * 1e6]
print(json.dumps(out))
"""


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return math.nan


def _prompts() -> dict[int, list[int]]:
    return {n: [(7 * n + i) % 30000 for i in range(n * BLOCK)] for n in PROMPT_BLOCKS}


def _ref(w: int) -> pb.InstanceRef:
    return pb.InstanceRef(worker_id=f"engine-{w}", dp_rank=0)


async def _fill(stub: Any, holders: int, prompts: dict[int, list[int]], tail: int) -> int:
    """Register the holders and store every prompt in each (plus a tail of its own)."""
    pairs = 0
    for w in range(holders):
        await stub.RegisterInstance(
            pb.RegisterInstanceRequest(
                instance=_ref(w), model=MODEL, address=f"http://e{w}", lease_ttl_seconds=600
            )
        )
        events = []
        h = 1
        for tokens in prompts.values():
            n = len(tokens) // BLOCK
            events.append(
                pb.Event(
                    stored=pb.BlockStored(
                        block_hashes=range(h, h + n), token_ids=tokens, block_size=BLOCK
                    )
                )
            )
            h += n
            pairs += n
        own = [(w * 100_003 + i) % 30000 for i in range(tail * BLOCK)]
        events.append(
            pb.Event(
                stored=pb.BlockStored(
                    block_hashes=range(h, h + tail), token_ids=own, block_size=BLOCK
                )
            )
        )
        pairs += tail
        batch = pb.EventBatch(instance=_ref(w), sequence=0, events=events)
        await stub.PublishEvents(pb.PublishEventsRequest(batch=batch))
    return pairs


def _time_calls(fn: Any, calls: int) -> tuple[float, float]:
    lat = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return percentile(lat, 0.5) * 1e6, percentile(lat, 0.99) * 1e6


def _dynamo(holders: int, chains: list[list[int]], calls: int) -> dict[str, list[float]] | None:
    try:
        python = dynamo_python(install=False)
    except RuntimeError as e:
        print(f"kvmesh bench follower: Dynamo not measured: {e}", file=sys.stderr)
        return None
    spec = json.dumps({"holders": holders, "chains": chains, "calls": calls})
    out = subprocess.run(
        [str(python), "-c", _DYNAMO_SCRIPT],
        input=spec.encode(),
        capture_output=True,
        check=True,
        timeout=600,
    )
    got: dict[str, list[float]] = json.loads(out.stdout)
    return got


def _ingest(target: str, holders: int, seconds: float, counts: dict[str, float]) -> None:
    """Publish for ``seconds`` (a thread of its own, blocking gRPC, 8 calls in
    flight): every holder a run of batches of 4 new 16-token blocks."""
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.IndexerServiceStub(ch)
        deadline = time.monotonic() + seconds
        seqs = dict.fromkeys(range(holders), 1)
        next_hash = 10_000_000
        applied = 0
        pending: list[Any] = []
        w = 0
        while time.monotonic() < deadline or pending:
            while len(pending) < 8 and time.monotonic() < deadline:
                tokens = [(next_hash + i) % 30000 for i in range(4 * BLOCK)]
                ev = pb.Event(
                    stored=pb.BlockStored(
                        block_hashes=range(next_hash, next_hash + 4),
                        token_ids=tokens,
                        block_size=BLOCK,
                    )
                )
                next_hash += 4
                batch = pb.EventBatch(instance=_ref(w), sequence=seqs[w], events=[ev])
                seqs[w] += 1
                w = (w + 1) % holders
                pending.append(
                    stub.PublishEvents.future(pb.PublishEventsRequest(batch=batch), timeout=30)
                )
            if pending:
                applied += pending.pop(0).result().ack.blocks_stored
        counts["blocks"] = applied


def _indexer(folder: Path, name: str, backend: dict[str, Any]) -> tuple[ChildProcess, str]:
    """``kvmesh indexer serve`` in a child process: (the child, its target)."""
    port = free_port()
    cfg = folder / f"{name}.json"
    cfg.write_text(
        json.dumps(
            {
                "host": HOST,
                "port": port,
                "metrics_port": 0,
                "block_size": BLOCK,
                "log_level": "WARNING",
                "watch": {"buffer": 65536},
                "quotas": {"publish_blocks_per_s": 0},
                **backend,
            }
        ),
        encoding="utf-8",
    )
    child = ChildProcess(
        [sys.executable, "-m", "kvmesh.cli", "indexer", "serve", "--config", str(cfg)],
        name=name,
        log_path=folder / f"{name}.log",
    )
    child.start()
    return child, f"{HOST}:{port}"


async def _wait_up(stub: Any) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            await stub.Ping(pb.PingRequest(), timeout=1)
            return
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def _ingest_child(target: str, holders: int, seconds: float, out: Any) -> None:
    counts: dict[str, float] = {}
    _ingest(target, holders, seconds, counts)
    out.put(counts.get("blocks", 0))


def _ingest_elsewhere(target: str, holders: int, seconds: float) -> float:
    """:func:`_ingest` in a process of its own (spawned): the publishers do not
    share the follower's interpreter, as in a fleet; the blocks applied."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_ingest_child, args=(target, holders, seconds, q), daemon=True)
    proc.start()
    try:
        blocks: float = q.get(timeout=seconds + 120)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return blocks


#: Holders predicted for each prompt's next turn, and the blocks it adds.
PREDICTED_HOLDERS = 16
PREDICTED_MORE = 8


async def _predicted(
    stub: Any,
    f: IndexFollower,
    args: argparse.Namespace,
    prompts: dict[int, list[int]],
    figures: dict[str, float],
) -> None:
    """Matches with predictions: the follower's (from the predictions its stream
    carries) against the indexer's, timed and compared."""
    n_pred = min(PREDICTED_HOLDERS, args.holders)
    turns = {}
    for n in PROMPT_BLOCKS:
        more = [30000 + (11 * n + i) % 20000 for i in range(PREDICTED_MORE * BLOCK)]
        turns[n] = block_keys(prompts[n] + more, BLOCK, MODEL)
        for w in range(n_pred):
            await stub.PredictPlacement(
                pb.PredictPlacementRequest(
                    model=MODEL, instance=_ref(w), block_keys=turns[n], ttl_ms=30_000
                )
            )
    last = turns[PROMPT_BLOCKS[-1]]
    for _ in range(1000):  # the follower holds them within the stream's delay
        out = f.match(MODEL, "", last, include_predicted=True)
        if out is not None and out.pending is not None and len(out.pending) == n_pred:
            break
        await asyncio.sleep(0.01)
    else:
        raise RuntimeError("the follower did not show the predictions within 10 s")
    wrong = 0
    for n in PROMPT_BLOCKS:
        k = turns[n]
        p50, p99 = _time_calls(
            lambda k=k: f.match(MODEL, "", k, include_predicted=True), args.calls
        )
        figures[f"follower_match_pred_{n}_p50_us"] = p50
        figures[f"follower_match_pred_{n}_p99_us"] = p99
        lat = []
        for _ in range(min(args.calls, 500)):
            t0 = time.perf_counter()
            r = await stub.Match(
                pb.MatchRequest(model=MODEL, block_keys=k, include_predicted=True), timeout=5
            )
            lat.append(time.perf_counter() - t0)
        figures[f"remote_match_pred_{n}_p50_us"] = percentile(lat, 0.5) * 1e6
        local = f.match(MODEL, "", k, include_predicted=True)
        want = (
            {(m.instance.worker_id, m.depth, m.predicted_depth) for m in r.matches},
            {p.instance.worker_id: p.predicted_blocks for p in r.pending},
        )
        got = (
            (
                {(w.split("/")[0], v.depth, v.predicted_depth) for w, v in local.matches.items()},
                {w.split("/")[0]: b for w, b in (local.pending or {}).items()},
            )
            if local is not None
            else None
        )
        wrong += got != want
    figures["follower_pred_wrong_answers"] = wrong


async def _run(args: argparse.Namespace, folder: Path) -> tuple[dict[str, float], dict[str, Any]]:
    if args.backend == "memory":
        return await _run_on(args, folder, None)
    with RedisProcess() as redis_proc:
        return await _run_on(args, folder, redis_proc.url)


async def _run_on(
    args: argparse.Namespace, folder: Path, redis_url: str | None
) -> tuple[dict[str, float], dict[str, Any]]:
    """Memory: one indexer, written and followed. Redis: two replicas over one
    Redis, every write to the first, the follower on the second (which serves
    the copy of the shared index it keeps, fed by the change stream)."""
    children: list[ChildProcess] = []
    if redis_url is None:
        child, target = _indexer(folder, "indexer", {"backend": "memory"})
        children.append(child)
        watched = target
    else:
        backend = {"backend": "redis", "redis": {"url": redis_url, "prefix": "bench"}}
        child, target = _indexer(folder, "writer", backend)
        children.append(child)
        child, watched = _indexer(folder, "watched", backend)
        children.append(child)
    figures: dict[str, float] = {}
    prompts = _prompts()
    keys = {n: block_keys(t, BLOCK, MODEL) for n, t in prompts.items()}
    try:
        ch = grpc.aio.insecure_channel(target)
        stub = pb_grpc.IndexerServiceStub(ch)
        await _wait_up(stub)
        if watched != target:
            async with grpc.aio.insecure_channel(watched) as wch:
                await _wait_up(pb_grpc.IndexerServiceStub(wch))
        pairs = await _fill(stub, args.holders, prompts, args.tail)
        rss0 = _rss_mb()
        f = IndexFollower(watched, models=[MODEL])
        await f.start()
        if not await f.wait_synced(120):
            raise RuntimeError("the follower did not sync within 120 s")
        rss1 = _rss_mb()
        figures["follower_bytes_per_block_instance"] = (rss1 - rss0) * 1024 * 1024 / pairs
        # Match latencies, idle.
        for n in PROMPT_BLOCKS:
            k = keys[n]
            out = f.match(MODEL, "", k)
            assert out is not None and len(out.matches) == args.holders, out
            p50, p99 = _time_calls(lambda k=k: f.match(MODEL, "", k), args.calls)
            figures[f"follower_match_{n}_p50_us"] = p50
            figures[f"follower_match_{n}_p99_us"] = p99
            lat = []
            for _ in range(min(args.calls, 500)):
                t0 = time.perf_counter()
                await stub.Match(pb.MatchRequest(model=MODEL, block_keys=k), timeout=5)
                lat.append(time.perf_counter() - t0)
            figures[f"remote_match_{n}_p50_us"] = percentile(lat, 0.5) * 1e6
        await _predicted(stub, f, args, prompts, figures)
        dyn = _dynamo(args.holders, [list(keys[n]) for n in PROMPT_BLOCKS], args.calls)
        for n in PROMPT_BLOCKS:
            if dyn is not None:
                figures[f"dynamo_inproc_match_{n}_p50_us"] = dyn[str(n)][0]
                figures[f"dynamo_inproc_match_{n}_p99_us"] = dyn[str(n)][1]
                figures[f"follower_over_dynamo_{n}_p50"] = (
                    figures[f"follower_match_{n}_p50_us"] / dyn[str(n)][0]
                )
        # Lag at full ingest.
        f.lag_s.clear()
        t0 = time.monotonic()
        if args.ingest_in == "thread":
            counts: dict[str, float] = {}
            await asyncio.to_thread(_ingest, target, args.holders, args.ingest_s, counts)
            blocks = counts.get("blocks", 0)
        else:
            blocks = await asyncio.to_thread(_ingest_elsewhere, target, args.holders, args.ingest_s)
        elapsed = time.monotonic() - t0
        figures["ingest_blocks_per_s"] = blocks / elapsed
        # A registration after the ingest: once the follower holds it, it holds
        # everything before it (changes come in order).
        marker = pb.InstanceRef(worker_id="marker", dp_rank=0)
        await stub.RegisterInstance(
            pb.RegisterInstanceRequest(instance=marker, model=MODEL, address="http://marker")
        )
        for _ in range(3000):  # at most a minute
            held = await f.index.list_instances()
            if any(s.spec.instance.worker_id == "marker" for s in held):
                break
            await asyncio.sleep(0.02)
        else:
            raise RuntimeError("the follower did not catch up within a minute of the ingest")
        lags = sorted(f.lag_s)
        figures["follower_lag_p50_ms"] = percentile(lags, 0.5) * 1e3 if lags else math.nan
        figures["follower_lag_p99_ms"] = percentile(lags, 0.99) * 1e3 if lags else math.nan
        wrong = 0
        for n in PROMPT_BLOCKS:
            for cut in (1, n // 2, n):
                k = keys[n][:cut]
                r = await stub.Match(pb.MatchRequest(model=MODEL, block_keys=k))
                local = f.match(MODEL, "", k)
                want = {(m.instance.worker_id, m.depth) for m in r.matches}
                got = (
                    {(w.split("/")[0], v.depth) for w, v in local.matches.items()}
                    if local is not None
                    else None
                )
                wrong += got != want
        figures["follower_wrong_answers"] = wrong
        figures["follower_resyncs"] = f.resyncs
        await f.close()
        await ch.close()
    finally:
        for c in children:
            c.stop()
    params = {
        "backend": args.backend,
        "holders": args.holders,
        "block_size": BLOCK,
        "prompt_blocks": list(PROMPT_BLOCKS),
        "tail_blocks": args.tail,
        "pairs": pairs,
        "calls": args.calls,
        "ingest_s": args.ingest_s,
        "ingest_in": args.ingest_in,
        "cpus": os.cpu_count(),
    }
    return figures, params


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh bench follower``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench follower",
        description="A router's follower (WatchIndex) beside the indexer's gRPC Match and "
        "Dynamo's in-process RadixTree, on the same index, in one run.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--json", dest="json_path", help="also write figures and params here")
    p.add_argument("--quick", action="store_true", help="CI-bounded sizes: figures indicative")
    p.add_argument("--holders", type=int, default=64, help="instances holding every prompt")
    p.add_argument("--tail", type=int, default=256, help="blocks of each holder's own")
    p.add_argument("--calls", type=int, default=2000, help="Matches timed per prompt")
    p.add_argument("--ingest-s", type=float, default=5.0, help="seconds of ingest for the lag")
    p.add_argument(
        "--ingest-in",
        choices=("thread", "process"),
        default="thread",
        help="where the publisher of the lag's ingest runs: a thread of the follower's process "
        "(sharing its interpreter), or a process of its own (one more process on the cores)",
    )
    p.add_argument(
        "--backend",
        choices=("memory", "redis"),
        default="memory",
        help="memory: one indexer, written and followed; redis: two replicas over one "
        "redis-server, written through one, followed through the other (its copy of the "
        "shared index, fed by the change stream): the lag is the write's, end to end",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.holders, args.tail, args.calls, args.ingest_s = 8, 16, 200, 1.0
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-follower-") as d:
        figures, params = asyncio.run(_run(args, Path(d)))
    rows = []
    for n in PROMPT_BLOCKS:
        rows.append(
            f"{n:>6} blocks  {fmt(figures[f'follower_match_{n}_p50_us']):>9} "
            f"{fmt(figures[f'follower_match_{n}_p99_us']):>9} "
            f"{fmt(figures.get(f'dynamo_inproc_match_{n}_p50_us')):>9} "
            f"{fmt(figures.get(f'dynamo_inproc_match_{n}_p99_us')):>9} "
            f"{fmt(figures.get(f'follower_over_dynamo_{n}_p50')):>7} "
            f"{fmt(figures[f'remote_match_{n}_p50_us']):>9}"
        )
    for n in PROMPT_BLOCKS:
        rows.append(
            f"{n:>6} + pred  {fmt(figures[f'follower_match_pred_{n}_p50_us']):>9} "
            f"{fmt(figures[f'follower_match_pred_{n}_p99_us']):>9} "
            f"{'-':>9} {'-':>9} {'-':>7} "
            f"{fmt(figures[f'remote_match_pred_{n}_p50_us']):>9}"
        )
    head = "prompt        fol p50us fol p99us dyn p50us dyn p99us  ratio  grpc p50us"
    foot = [
        f"lag at {fmt(figures['ingest_blocks_per_s'])} blocks/s ingest: "
        f"p50 {fmt(figures['follower_lag_p50_ms'])} ms, "
        f"p99 {fmt(figures['follower_lag_p99_ms'])} ms; "
        f"{fmt(figures['follower_bytes_per_block_instance'])} B per (block, instance); "
        f"wrong answers {int(figures['follower_wrong_answers'])} "
        f"({int(figures['follower_pred_wrong_answers'])} with predictions); "
        f"resyncs {int(figures['follower_resyncs'])}",
        f"{params['backend']} backend; "
        f"{params['holders']} holders of every prompt block, {BLOCK}-token blocks; ratio: follower "
        "p50 / Dynamo find_matches p50 (same blocks, same holders, each in its own process)",
    ]
    print(table(head, rows, foot))
    if args.json_path:
        write_report(args.json_path, figures, params)
    wrong = figures["follower_wrong_answers"] + figures["follower_pred_wrong_answers"]
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
