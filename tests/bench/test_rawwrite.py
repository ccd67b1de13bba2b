"""The raw pipelined write that ``kvmesh bench peer`` compares Redis ingest with."""

from __future__ import annotations

import subprocess

import redis

from lab.bench.rawwrite import raw_pipelined_write, resp_commands
from lab.redisproc import RedisProcess


def test_the_commands_write_one_block_hash_per_pair_and_one_map_per_instance() -> None:
    with RedisProcess() as rp:
        done = subprocess.run(
            ["redis-cli", "-p", str(rp.port), "--pipe"],
            input=resp_commands(5_000, 7),
            capture_output=True,
            check=True,
        )
        assert b"errors: 0, replies: 10000" in done.stdout
        r = redis.Redis(port=rp.port)
        try:
            assert r.dbsize() == 5_000 + 7
            assert sum(r.hlen(f"raw:e:{i}") for i in range(7)) == 5_000
        finally:
            r.close()


def test_a_timed_write_measures_and_leaves_nothing_behind() -> None:
    with RedisProcess() as rp:
        r = redis.Redis(port=rp.port)
        try:
            r.set("mine", "kept")
            w = raw_pipelined_write("127.0.0.1", rp.port, 20_000, 16)
            assert w.pairs == 20_000 and w.seconds > 0 and w.pairs_per_s > 1_000
            # two HSETs a pair: more than their payload (8 + 16 + 24 bytes), far from a KiB
            assert 48 < w.bytes_per_pair < 1024
            assert r.dbsize() == 1 and r.get("mine") == b"kept"
        finally:
            r.close()
