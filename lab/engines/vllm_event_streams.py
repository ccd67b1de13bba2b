"""vLLM ``ZmqEventPublisher``\\ s streaming planned stores, removals and clears, paced.

Run with the interpreter of a virtualenv that has vLLM (``python -m
lab.engines.vllm_event_streams --dir DIR`` with the repository on
``PYTHONPATH``); ``tests/integration/test_bridge.py`` starts one for its
engines. Like ``vllm_publishers.py`` (whose trace tokens, engine hashes,
endpoints and batch encoding it uses) it imports the standard library,
numpy, msgspec and vLLM only, never kvmesh.

What runs is vLLM's own publisher: one ``ZmqEventPublisher`` per stream (PUB
plus replay ROUTER on ``ipc://`` endpoints, which vLLM binds; its publisher
thread, sequence numbers and replay buffer of ``buffer_steps`` batches), fed
vLLM's own ``KVEventBatch`` of ``BlockStored``, ``BlockRemoved`` and
``AllBlocksCleared``, encoded as its publisher thread does when the plan is
opened. Unlike ``vllm_publishers.py`` the plan may remove blocks and clear
caches, so what an engine holds at the end is its stores minus its removals
(the truth a test compares an index with), and a stream is paced: one batch
per stream every ``interval_s``, so that faults can strike while it flows.

A plan (JSON): ``{"block_size": B, "buffer_steps": N, "interval_s": T,
"streams": [[batch, ...], ...]}``, a batch a list of events, each
``["store", ids, parent]`` (trace block ids, 512 tokens each, split into
512 / B engine blocks; ``parent`` the id before them or null),
``["remove", ids]`` (every engine block of those ids) or ``["clear"]``.
``"endpoints": [[pub, replay], ...]`` gives each stream's endpoints instead of
the ``ipc://`` defaults, as vLLM's ``kv_events_config`` would: a tcp endpoint
with a concrete host (``tcp://127.0.0.1:5557``) makes vLLM's PUB socket
connect to a subscriber that binds it (the bridge's sidecar layout), while its
replay socket always binds.

Protocol (stdout is the protocol only): ``READY {...}`` once vLLM is
imported, then for each stdin line the answer ``OK <cmd> R``:

- ``open R PLAN``: read the plan, encode it, open a publisher per stream at
  :func:`lab.engines.vllm_publishers.endpoints` ``(DIR, R, i)``.
- ``go R``: answered at once; the streams then flow, interleaved, and
  ``OK sent R`` follows once every publisher thread has sent every batch.
- ``close R``: the round's publishers shut down.

Closing stdin stops the program.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from lab.engines.vllm_publishers import (
    TRACE_BLOCK_TOKENS,
    encode_batch,
    endpoints,
    engine_hashes,
    trace_tokens,
)


def encode_event(event: Sequence[Any], block_size: int) -> Any:
    """One plan event as vLLM's own event struct."""
    from vllm.distributed.kv_events import (  # type: ignore[import-not-found]
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
    )

    sub = TRACE_BLOCK_TOKENS // block_size
    kind = event[0]
    if kind == "store":
        ids, parent = event[1], event[2]
        return BlockStored(
            block_hashes=engine_hashes(ids, sub),
            parent_block_hash=engine_hashes([parent], sub)[-1] if parent is not None else None,
            token_ids=trace_tokens(ids).reshape(-1).tolist(),
            block_size=block_size,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
    if kind == "remove":
        return BlockRemoved(block_hashes=engine_hashes(event[1], sub), medium="GPU")
    if kind == "clear":
        return AllBlocksCleared()
    raise SystemExit(f"unknown plan event {event!r}")


class Round:
    """One plan's publishers and its encoded streams."""

    def __init__(self, plan: dict[str, Any], sock_dir: str, r: int) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        block_size = int(plan["block_size"])
        if block_size < 1 or TRACE_BLOCK_TOKENS % block_size:
            raise SystemExit(f"block size {block_size} does not divide {TRACE_BLOCK_TOKENS}")
        self.interval_s = float(plan.get("interval_s", 0.0))
        self.streams = [
            [encode_batch([encode_event(ev, block_size) for ev in batch]) for batch in stream]
            for stream in plan["streams"]
        ]
        self.pubs = []
        given = plan.get("endpoints")
        for i in range(len(self.streams)):
            endpoint, replay = given[i] if given else endpoints(sock_dir, r, i)
            self.pubs.append(
                ZmqEventPublisher(
                    data_parallel_rank=0,
                    endpoint=endpoint,
                    replay_endpoint=replay,
                    buffer_steps=int(plan.get("buffer_steps", 10_000)),
                )
            )

    def stream(self) -> None:
        """Every stream's batches, one per stream per interval, then wait until all are sent."""
        import msgspec

        longest = max((len(s) for s in self.streams), default=0)
        for k in range(longest):
            for pub, stream in zip(self.pubs, self.streams, strict=True):
                if k < len(stream):
                    # A Raw comes out of the publisher thread's encoder as the bytes it
                    # holds: vLLM's own thread, socket, sequence counter and replay buffer.
                    pub._event_queue.put(msgspec.Raw(stream[k]))
            if self.interval_s:
                time.sleep(self.interval_s)
        for pub in self.pubs:
            pub._event_queue.join()

    def close(self) -> None:
        if self.pubs:
            with ThreadPoolExecutor(len(self.pubs)) as pool:
                list(pool.map(lambda p: p.shutdown(), self.pubs))
        self.pubs = []


def main(argv: Sequence[str] | None = None) -> int:
    """Import vLLM, announce READY, then serve commands until stdin closes."""
    p = argparse.ArgumentParser(
        prog="python -m lab.engines.vllm_event_streams", description=__doc__
    )
    p.add_argument("--dir", required=True, help="folder of the ipc:// endpoints")
    args = p.parse_args(argv)
    # The protocol owns stdout; whatever vLLM prints goes to stderr.
    out: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import vllm  # type: ignore[import-not-found]
    import vllm.distributed.kv_events  # type: ignore[import-not-found]  # before the clock

    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            out.write(line + "\n")

    rounds: dict[int, Round] = {}
    say("READY " + json.dumps({"vllm": str(vllm.__version__)}))

    def go(r: int) -> None:
        rounds[r].stream()
        say(f"OK sent {r}")

    try:
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            cmd, r = words[0], int(words[1])
            if cmd == "open":
                with open(words[2], encoding="utf-8") as f:
                    rounds[r] = Round(json.load(f), args.dir, r)
            elif cmd == "go":
                say(f"OK go {r}")  # before the thread can say it sent everything
                threading.Thread(target=go, args=(r,), daemon=True).start()
                continue
            elif cmd == "close":
                rounds.pop(r).close()
            else:
                raise SystemExit(f"unknown command {line.strip()!r}")
            say(f"OK {cmd} {r}")
    finally:
        for rnd in rounds.values():
            rnd.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
