"""Many vLLM ``ZmqEventPublisher``\\ s in one process, streaming a pre-encoded trace on cue.

Run with the interpreter of a virtualenv that has vLLM (``python -m
lab.engines.vllm_publishers --plan FILE --proc K --procs P --dir DIR`` with
the repository on ``PYTHONPATH``); ``kvmesh bench peer`` starts a few of them
(``lab/bench/peer_procs.py``). Process ``K`` of ``P`` serves the plan's
instances ``i`` with ``i % P == K``. It imports the standard library, numpy,
msgspec and vLLM only, never kvmesh, so the bench's side can import the pure
functions at the top of this module (tokens and engine hashes of a trace
block) without vLLM.

What runs is vLLM's own publisher: one ``ZmqEventPublisher`` per instance
(PUB plus replay ROUTER on ``ipc://`` endpoints, which vLLM binds, so the
indexers connect as they do to a real engine), its publisher thread, its
sequence numbers and its replay buffer. Only the encoding is moved before
the clock: every batch is built from vLLM's own ``KVEventBatch`` and
``BlockStored`` and encoded with msgspec's msgpack encoder, as the
publisher thread does, when the process starts; on ``go`` each batch enters
the publisher's queue as ``msgspec.Raw``, which that thread's encoder writes
out unchanged. The bytes on the wire are the ones vLLM would send.

Blocks: the plan names each event's new blocks by trace block id (512
tokens each, chained by prefix). With ``--block-size`` B each trace block
becomes 512 / B engine blocks whose tokens are :func:`trace_tokens` and whose
engine hashes are :func:`engine_hashes`: 64-bit values that, like vLLM's int
block hashes, are unique per prefix (a trace id names a prefix, so
(id, sub-block) does). Both indexers key blocks by their tokens, not by these
values; the hashes tie a block to its parent and name it in removals.

Protocol (stdout is the protocol only; anything a library prints goes to
stderr): ``READY {...}`` once the batches are encoded, then for each stdin
line ``open R``, ``warm R``, ``go R`` or ``close R`` the answer ``OK <cmd> R``:

- ``open R``: a publisher per instance at :func:`endpoints` ``(DIR, R, i)``.
- ``warm R``: each publisher of round R publishes one batch storing the
  warm-up block (what tells the bench every subscription is live).
- ``go R``: every instance's batches (the trace, then the sentinel block)
  enter the queues, instances interleaved; answered once every publisher
  thread has sent all of them.
- ``close R``: the round's publishers shut down.

Closing stdin stops the program.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import numpy as np

#: Tokens per block of the trace's ids.
TRACE_BLOCK_TOKENS = 512
#: Token ids are drawn from [TOKEN_BASE, TOKEN_BASE + VOCAB).
TOKEN_BASE = 100
VOCAB = 50_000
#: Trace ids of the warm-up and sentinel blocks: far past the trace's ids, so
#: no trace prompt starts with either.
WARMUP_ID = 1 << 40
SENTINEL_ID = (1 << 40) + 1
#: Seeds that make tokens and engine hashes different functions of an id.
_TOKEN_SEED = np.uint64(0x6B766D6573682D74)
_HASH_SEED = np.uint64(0x6B766D6573682D68)

#: One event of a plan: the new trace ids it stores, and the trace id of the
#: block just before them (None: the chain starts the prompt).
PlanEvent = tuple[Sequence[int], int | None]


def _mix(x: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """SplitMix64's finalizer, element-wise (a bijection of 64-bit values)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def trace_tokens(ids: Sequence[int]) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """The 512 token ids of each trace block id, shape ``(len(ids), 512)``.

    Equal ids give equal tokens, so the trace's prefix sharing carries over.
    """
    pos = np.arange(TRACE_BLOCK_TOKENS, dtype=np.uint64)
    base = (np.asarray(ids, dtype=np.uint64)[:, None] << np.uint64(9)) | pos
    return (np.uint64(TOKEN_BASE) + _mix(base ^ _TOKEN_SEED) % np.uint64(VOCAB)).astype(np.uint32)


def engine_hashes(ids: Sequence[int], sub_blocks: int) -> list[int]:
    """Engine block hashes of ``ids``, each split into ``sub_blocks`` blocks, in order."""
    sub = np.arange(sub_blocks, dtype=np.uint64)
    base = (np.asarray(ids, dtype=np.uint64)[:, None] << np.uint64(10)) | sub
    return [int(h) for h in _mix(base.reshape(-1) ^ _HASH_SEED)]


def endpoints(sock_dir: str, r: int, i: int) -> tuple[str, str]:
    """PUB and replay endpoints of instance ``i`` in round ``r``."""
    return f"ipc://{sock_dir}/r{r}e{i}.pub", f"ipc://{sock_dir}/r{r}e{i}.rep"


# -- encoding (vLLM's structs) -----------------------------------------------------


def _stored(ids: Sequence[int], parent: int | None, block_size: int, only_first: bool) -> Any:
    from vllm.distributed.kv_events import BlockStored  # type: ignore[import-not-found]

    sub = TRACE_BLOCK_TOKENS // block_size
    tokens = trace_tokens(ids).reshape(-1)
    hashes = engine_hashes(ids, sub)
    if only_first:
        tokens, hashes = tokens[:block_size], hashes[:1]
    parent_hash = engine_hashes([parent], sub)[-1] if parent is not None else None
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent_hash,
        token_ids=tokens.tolist(),
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def _msgspec() -> Any:
    import msgspec

    return msgspec


def encode_batch(events: Sequence[Any]) -> bytes:
    """One ``KVEventBatch`` of vLLM's events, encoded as vLLM's publisher thread does."""
    from vllm.distributed.kv_events import KVEventBatch

    batch = KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0)
    return bytes(_msgspec().msgpack.Encoder().encode(batch))


def encode_stream(batches: Sequence[Sequence[PlanEvent]], block_size: int) -> list[bytes]:
    """An instance's batches, then the sentinel batch, each encoded."""
    out = [
        encode_batch([_stored(ids, parent, block_size, False) for ids, parent in batch])
        for batch in batches
    ]
    out.append(encode_batch([_stored([SENTINEL_ID], None, block_size, True)]))
    return out


# -- the publishers ------------------------------------------------------------------


class Fleet:
    """This process's instances: their encoded streams and their publishers per round."""

    def __init__(self, streams: dict[int, list[bytes]], warmup: bytes, sock_dir: str) -> None:
        self.streams = streams
        self.warmup = warmup
        self.sock_dir = sock_dir
        self.rounds: dict[int, dict[int, Any]] = {}

    def open(self, r: int) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        pubs = {}
        for i in self.streams:
            endpoint, replay = endpoints(self.sock_dir, r, i)
            pubs[i] = ZmqEventPublisher(
                data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay
            )
        self.rounds[r] = pubs

    @staticmethod
    def _put(pub: Any, payload: bytes) -> None:
        # The publisher thread encodes what it takes from its queue; a Raw
        # comes out as the bytes it holds, so the pre-encoded batch goes out
        # through vLLM's own thread, socket, sequence counter and replay buffer.
        pub._event_queue.put(_msgspec().Raw(payload))

    def warm(self, r: int) -> None:
        for pub in self.rounds[r].values():
            self._put(pub, self.warmup)
        self._drain(r)

    def go(self, r: int) -> None:
        pubs = self.rounds[r]
        longest = max((len(s) for s in self.streams.values()), default=0)
        for k in range(longest):
            for i, pub in pubs.items():
                stream = self.streams[i]
                if k < len(stream):
                    self._put(pub, stream[k])
        self._drain(r)

    def _drain(self, r: int) -> None:
        for pub in self.rounds[r].values():
            pub._event_queue.join()  # every batch taken and sent (task_done after the send)

    def close(self, r: int) -> None:
        pubs = self.rounds.pop(r, {})
        if pubs:
            with ThreadPoolExecutor(len(pubs)) as pool:
                list(pool.map(lambda p: p.shutdown(), pubs.values()))

    def close_all(self) -> None:
        for r in list(self.rounds):
            self.close(r)


def _load(plan_path: str, proc: int, procs: int) -> tuple[int, dict[int, list[bytes]], int]:
    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    block_size = int(plan["block_size"])
    if block_size < 1 or TRACE_BLOCK_TOKENS % block_size:
        raise SystemExit(f"block size {block_size} does not divide {TRACE_BLOCK_TOKENS}")
    streams: dict[int, list[bytes]] = {}
    size = 0
    for i, batches in enumerate(plan["streams"]):
        if i % procs != proc:
            continue
        events = [[(ev[0], ev[1]) for ev in batch] for batch in batches]
        streams[i] = encode_stream(events, block_size)
        size += sum(len(p) for p in streams[i])
    return block_size, streams, size


def main(argv: Sequence[str] | None = None) -> int:
    """Encode this process's streams, announce READY, then serve commands until stdin closes."""
    p = argparse.ArgumentParser(prog="python -m lab.engines.vllm_publishers", description=__doc__)
    p.add_argument("--plan", required=True, help="JSON plan written by the bench")
    p.add_argument("--proc", type=int, required=True, help="this process's index")
    p.add_argument("--procs", type=int, required=True, help="publisher processes in all")
    p.add_argument("--dir", required=True, help="folder of the ipc:// endpoints")
    args = p.parse_args(argv)
    # The protocol owns stdout; whatever vLLM prints goes to stderr.
    out: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import vllm  # type: ignore[import-not-found]
    import vllm.distributed.kv_events  # type: ignore[import-not-found]  # before the clock

    t0 = time.perf_counter()
    block_size, streams, size = _load(args.plan, args.proc, args.procs)
    warmup = encode_batch([_stored([WARMUP_ID], None, block_size, True)])

    fleet = Fleet(streams, warmup, args.dir)
    ready = {
        "instances": sorted(streams),
        "batches": sum(len(s) for s in streams.values()),
        "bytes": size,
        "encode_s": round(time.perf_counter() - t0, 3),
        "vllm": str(vllm.__version__),
    }
    out.write("READY " + json.dumps(ready) + "\n")
    actions = {"open": fleet.open, "warm": fleet.warm, "go": fleet.go, "close": fleet.close}
    try:
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd not in actions:
                raise SystemExit(f"unknown command {line.strip()!r}")
            actions[cmd](int(arg))
            out.write(f"OK {cmd} {arg}\n")
    finally:
        fleet.close_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
