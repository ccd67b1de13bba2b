"""``kvmesh bench holders``: what a block held by many instances costs the memory backend.

Each case stores one chain of ``blocks`` block keys in each of ``holders``
instances of a fresh :class:`indexer.memory.MemoryIndex`, in a child process
of its own (so that one case's freed memory does not flatter the next), and
measures:

- ``holders_<H>_bytes_per_block_instance``: the process's RSS growth over
  the (block, instance) pairs stored;
- ``holders_<H>_full_collection_ms``: one ``gc.collect()`` after the stores
  (what every full collection of a replica holding such an index pays; the
  shared blocks' holder sets are interned, so it walks one entry per
  distinct set, not per block);
- ``holders_<H>_match_p50_us``: Match of the chain's first ``--prompt``
  blocks (every holder holds them alike: the run is measured in one pass).

The cases are ``(blocks, holders)``: 200,000 x 1 (nothing shared, the
baseline), 20,000 x 64, 200,000 x 4 and 1,000,000 x 2; ``--quick`` divides
the blocks by 20. The same index code is the router's follower copy.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvmesh.clihelp import HelpFormatter
from kvmesh.stats import percentile
from lab.bench.report import fmt, table, write_report
from lab.children import child_env

#: (blocks, holders) per case; the first shares nothing (the baseline).
CASES = ((200_000, 1), (20_000, 64), (200_000, 4), (1_000_000, 2))
#: Blocks per stored event (vLLM sends up to 16 k at 16-token blocks).
EVENT_BLOCKS = 4096
#: Matches timed per case.
CALLS = 500


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def _case(blocks: int, holders: int, prompt: int) -> dict[str, float]:
    from indexer.memory import MemoryIndex
    from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace

    rnd = random.Random(blocks * 131 + holders)
    keys = [rnd.getrandbits(63) for _ in range(blocks)]
    index = MemoryIndex()
    gc.collect()
    before = _rss()
    for w in range(holders):
        iid = InstanceId(f"engine-{w}", 0)
        await index.register(InstanceSpec(iid, "m", f"http://e{w}", 3600.0, "a"))
        for seq, lo in enumerate(range(0, blocks, EVENT_BLOCKS)):
            chunk = tuple(keys[lo : lo + EVENT_BLOCKS])
            hashes = tuple(range(lo + 1, lo + 1 + len(chunk)))
            ev = BlockStored(hashes, None, (), 16, block_keys=chunk, position_known=False)
            await index.apply(EventBatch(iid, seq, (ev,)))
    grown = _rss() - before
    t0 = time.perf_counter()
    gc.collect()
    collect_s = time.perf_counter() - t0
    query = keys[:prompt]
    ns = Namespace("m")
    lat = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        hits = index.match_sync(ns, query)
        lat.append(time.perf_counter() - t0)
    assert len(hits) == holders and all(h.depth == len(query) for h in hits), hits[:2]
    return {
        "bytes_per_block_instance": grown / (blocks * holders),
        "full_collection_ms": collect_s * 1e3,
        "match_p50_us": percentile(lat, 0.5) * 1e6,
    }


def _run_case(blocks: int, holders: int, prompt: int) -> dict[str, float]:
    """One case in a child process: its figures."""
    out = subprocess.run(
        [sys.executable, "-m", "lab.bench.holders", "--case", f"{blocks},{holders},{prompt}"],
        check=True,
        capture_output=True,
        text=True,
        env=child_env(None),
    )
    figures: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh bench holders``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench holders",
        description="What blocks held by many instances cost the memory backend: bytes per "
        "(block, instance), a full collection, Match over a run held alike.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--json", dest="json_path", help="also write figures and params here")
    p.add_argument("--quick", action="store_true", help="a twentieth of the blocks (CI sizes)")
    p.add_argument("--prompt", type=int, default=1024, help="blocks of the Match timed")
    p.add_argument("--case", help=argparse.SUPPRESS)  # BLOCKS,HOLDERS,PROMPT: one child's case
    args = p.parse_args(argv)
    if args.case:
        blocks, holders, prompt = (int(x) for x in args.case.split(","))
        print(json.dumps(asyncio.run(_case(blocks, holders, prompt))))
        return 0
    if args.prompt < 1:
        p.error("--prompt must be >= 1")
    figures: dict[str, float] = {}
    rows = []
    cases = [(b // 20 if args.quick else b, h) for b, h in CASES]
    for blocks, holders in cases:
        got = _run_case(blocks, holders, min(args.prompt, blocks))
        for name, value in got.items():
            figures[f"holders_{holders}_{name}"] = value
        rows.append(
            f"{blocks:>10,} {holders:>7} {fmt(got['bytes_per_block_instance']):>10} "
            f"{fmt(got['full_collection_ms']):>10} {fmt(got['match_p50_us']):>10}"
        )
    base = figures["holders_1_bytes_per_block_instance"]
    for _, holders in cases[1:]:
        figures[f"ratio_holders_{holders}_bytes"] = (
            figures[f"holders_{holders}_bytes_per_block_instance"] / base
        )
    head = "    blocks holders   B/(b,i)   gc full ms  match p50us"
    foot = [
        "one chain stored by every holder, each case in a process of its own; "
        f"Match over the first {args.prompt} blocks; bytes against 1 holder: "
        + ", ".join(f"{h}: {fmt(figures[f'ratio_holders_{h}_bytes'])}" for _, h in cases[1:])
    ]
    print(table(head, rows, foot))
    params: dict[str, Any] = {"cases": cases, "prompt": args.prompt, "quick": args.quick}
    if args.json_path:
        write_report(args.json_path, figures, params)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
