"""What Redis itself accepts: a raw pipelined write of (block, instance) entries.

The physical limit of the Redis backend's ingest, for ``kvmesh bench peer``:
the same number of (block, instance) pairs written with nothing but the two
commands each pair costs at the least in kvmesh's schema (indexer/redis/KEYS.md)

- ``HSET P:b:<ns><u64 key> <id> <mask>``: the block's holder entry, and
- ``HSET P:e:<id> <u64 engine hash> <ns><u64 key>``: the instance's engine-hash entry,

with no script, no sequence check, no parent lookup and no counters, sent by
``redis-cli --pipe`` (the protocol written straight onto the socket, replies
read back as they come) from a file made before the clock starts. Keys are
distinct and spread over ``instances`` ids like the stream's, so the server's
work (hash tables, listpacks, memory) is the same kind; the figure is pairs
per second from the first byte sent to the last reply read.
"""

from __future__ import annotations

import os
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass

#: Pairs written at most: the rate is steady long before (and the file stays
#: a few hundred MB).
MAX_PAIRS = 2_000_000
_PAIRS_PER_CHUNK = 50_000


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def resp_commands(pairs: int, instances: int, prefix: bytes = b"raw") -> bytes:
    """The RESP of ``pairs`` (block, instance) pairs: two HSETs each."""
    hset = b"*4\r\n" + _bulk(b"HSET")
    ns = struct.pack(">Q", 0x6B766D657368)  # a fixed namespace id
    b_prefix = prefix + b":b:" + ns
    e_prefixes = [_bulk(prefix + b":e:" + str(i).encode()) for i in range(instances)]
    ids = [_bulk(str(i).encode()) for i in range(instances)]
    mask = _bulk(b"1")
    out: list[bytes] = []
    for n in range(pairs):
        i = n % instances
        key = struct.pack(">Q", (n * 0x9E3779B97F4A7C15) & ((1 << 64) - 1))
        out.append(hset + _bulk(b_prefix + key) + ids[i] + mask)
        out.append(hset + e_prefixes[i] + _bulk(struct.pack(">Q", n)) + _bulk(ns + key))
    return b"".join(out)


@dataclass(frozen=True, slots=True)
class RawWrite:
    """One timed raw write."""

    pairs: int
    seconds: float
    #: Redis ``used_memory`` growth per pair: the schema's floor in bytes.
    bytes_per_pair: float

    @property
    def pairs_per_s(self) -> float:
        """(block, instance) pairs per second."""
        return self.pairs / self.seconds if self.seconds > 0 else 0.0


def raw_pipelined_write(
    host: str, port: int, pairs: int, instances: int, *, prefix: bytes = b"raw"
) -> RawWrite:
    """Write ``min(pairs, MAX_PAIRS)`` pairs with ``redis-cli --pipe`` and time it.

    The keys go under ``prefix`` and are deleted afterwards (FLUSHDB is not
    used: the server may hold the index being measured). Raises
    ``RuntimeError`` when redis-cli reports errors.
    """
    n = max(1, min(pairs, MAX_PAIRS))
    fd, path = tempfile.mkstemp(prefix="kvmesh-raw-", suffix=".resp")
    try:
        with os.fdopen(fd, "wb") as f:
            for start in range(0, n, _PAIRS_PER_CHUNK):
                chunk = min(_PAIRS_PER_CHUNK, n - start)
                f.write(resp_commands(chunk, instances, prefix + b"%d" % start))
        mem0 = _used_memory(host, port)
        with open(path, "rb") as src:
            t0 = time.perf_counter()
            done = subprocess.run(
                ["redis-cli", "-h", host, "-p", str(port), "--pipe"],
                stdin=src,
                capture_output=True,
                text=True,
                check=False,
            )
            seconds = time.perf_counter() - t0
        if done.returncode != 0 or "errors: 0," not in done.stdout:
            raise RuntimeError(f"redis-cli --pipe: {done.stdout.strip()} {done.stderr.strip()}")
        return RawWrite(n, seconds, (_used_memory(host, port) - mem0) / n)
    finally:
        os.unlink(path)
        _delete_prefix(host, port, prefix)


def _used_memory(host: str, port: int) -> int:
    import redis

    r = redis.Redis(host=host, port=port)
    try:
        return int(r.info("memory")["used_memory"])
    finally:
        r.close()


def _delete_prefix(host: str, port: int, prefix: bytes) -> None:
    import redis

    r = redis.Redis(host=host, port=port)
    try:
        batch: list[bytes] = []
        for name in r.scan_iter(match=prefix + b"*", count=10_000):
            batch.append(name)
            if len(batch) >= 10_000:
                r.unlink(*batch)
                batch = []
        if batch:
            r.unlink(*batch)
    finally:
        r.close()
