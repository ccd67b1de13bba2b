"""``kvmesh quickstart``: the indexer's main job on embedded defaults, in one command.

Starts an indexer in this process (memory backend, a free port on
127.0.0.1), registers a few simulated engine instances, publishes the bundled
Mooncake conversation trace over the streaming publish call exactly as
engines would, asks Match for some prompts of the trace, and prints what
happened. No Redis, no configuration, no network beyond loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence

import grpc.aio

from indexer.config import IndexerConfig, Limits
from indexer.server import start_server
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.clihelp import HelpFormatter
from kvmesh.runtime import new_event_loop
from kvmesh.stats import percentile
from lab.traces import MOONCAKE_BLOCK_SIZE, load_mooncake
from lab.workload import (
    TRACE_MODEL,
    make_instances,
    match_request,
    plan_publish,
    publish_plan,
    register_all,
    sample_prompts,
)

#: Matches timed for the latency line (enough for a stable median, well under a second).
LATENCY_SAMPLES = 300


def quickstart_config() -> IndexerConfig:
    """The embedded defaults the quickstart serves with: memory backend, free port."""
    return IndexerConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        backend="memory",
        model_block_sizes={TRACE_MODEL: MOONCAKE_BLOCK_SIZE},
        # 512-token blocks: keep the largest possible token prompt within one message.
        limits=Limits(max_match_blocks=4096),
    )


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} µs"


async def run(n_instances: int, n_requests: int | None, n_prompts: int) -> str:
    """Do the whole quickstart; return the report to print."""
    t_start = time.perf_counter()
    trace = load_mooncake(limit=n_requests)
    instances = make_instances(n_instances)
    plan = plan_publish(trace, instances)
    server = await start_server(quickstart_config())
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.IndexerServiceStub(channel)
            await register_all(stub, instances)
            publish_s = await publish_plan(stub, plan)
            stats = await stub.GetStats(pb.GetStatsRequest())
            listing = await stub.ListInstances(pb.ListInstancesRequest(model=TRACE_MODEL))

            prompts = sample_prompts(trace, 32, n_prompts)
            shown: list[tuple[int, pb.MatchResponse]] = []
            for keys in prompts:
                shown.append((len(keys), await stub.Match(match_request(keys))))

            lat: list[float] = []
            reqs = [match_request(k) for k in sample_prompts(trace, 32, 64)] or [
                match_request(prompts[0])
            ]
            for i in range(LATENCY_SAMPLES):
                t0 = time.perf_counter()
                await stub.Match(reqs[i % len(reqs)])
                lat.append(time.perf_counter() - t0)
            ping: list[float] = []
            for _ in range(LATENCY_SAMPLES):
                t0 = time.perf_counter()
                await stub.Ping(pb.PingRequest())
                ping.append(time.perf_counter() - t0)
    finally:
        await server.stop(0)

    out: list[str] = []
    out.append(f"kvmesh quickstart: indexer on {server.address} (backend memory)")
    out.append(
        f"trace: {len(trace):,} requests of the Mooncake conversation trace, "
        f"{MOONCAKE_BLOCK_SIZE}-token blocks"
    )
    out.append("")
    out.append(f"{'instance':<12} {'address':<26} {'blocks':>8} {'live':>5} {'seq':>5}")
    for info in listing.instances:
        out.append(
            f"{info.instance.worker_id:<12} {info.address:<26} {info.blocks:>8,} "
            f"{'yes' if info.live else 'no':>5} {info.applied_sequence:>5}"
        )
    out.append("")
    out.append(f"instances registered    {stats.instances:>12,}")
    out.append(f"distinct blocks indexed {stats.blocks:>12,}")
    out.append(f"(block, instance) pairs {stats.block_instances:>12,}")
    out.append(
        f"ingest (stream publish) {plan.blocks / publish_s:>12,.0f} blocks/s  "
        f"({plan.blocks:,} blocks in {plan.batch_count:,} batches, {publish_s:.2f} s)"
    )
    out.append(f"Match latency p50       {_us(percentile(lat, 0.5)):>12}  (32-block prompts)")
    out.append(f"Match latency p99       {_us(percentile(lat, 0.99)):>12}")
    out.append(f"Ping latency p50        {_us(percentile(ping, 0.5)):>12}  (empty call: the floor)")
    out.append("")
    out.append("Sample matches (deepest first; every request shares block 0, so every")
    out.append("instance holds at least 1 block of every prompt):")
    for n, (total, resp) in enumerate(shown, start=1):
        top = ", ".join(f"{m.instance.worker_id} depth {m.depth}" for m in resp.matches[:3])
        out.append(
            f"  prompt {n}: {total} blocks -> {len(resp.matches)} instances; top: {top or '-'}"
        )
    out.append("")
    out.append(f"done in {time.perf_counter() - t_start:.1f} s")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh quickstart``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh quickstart",
        description="Start an in-process indexer, publish the bundled trace, run matches.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--instances", type=int, default=8, help="simulated engines")
    p.add_argument(
        "--requests", type=int, default=None, help="trace requests to publish (default: all)"
    )
    p.add_argument("--prompts", type=int, default=5, help="sample matches to show")
    args = p.parse_args(argv)
    if args.instances < 1:
        p.error("--instances must be >= 1")
    if args.requests is not None and args.requests < 1:
        p.error("--requests must be >= 1")
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        report = runner.run(run(args.instances, args.requests, args.prompts))
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
