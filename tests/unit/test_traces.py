"""The bundled Mooncake trace, its loader, and the replay plan built from it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from lab.traces import load_mooncake, trace_block_key
from lab.workload import make_instances, plan_publish, prompt_keys, sample_prompts


def test_bundled_trace_facts() -> None:
    trace = load_mooncake()
    assert len(trace) == 12031
    assert all(r.hash_ids[0] == 0 for r in trace)
    assert sum(len(r.hash_ids) for r in trace) == 288_500
    assert len({h for r in trace for h in r.hash_ids}) == 182_790
    assert max(len(r.hash_ids) for r in trace) == 247
    assert sum(len(r.hash_ids) >= 32 for r in trace) == 2859
    first = trace[0]
    assert (first.timestamp, first.input_length, first.output_length) == (0.0, 6758, 500)
    assert first.hash_ids == tuple(range(14))


def test_limit_and_custom_path(tmp_path: Path) -> None:
    assert len(load_mooncake(limit=7)) == 7
    rows = [{"timestamp": 5, "input_length": 600, "output_length": 2, "hash_ids": [0, 9]}]
    plain = tmp_path / "t.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        (req,) = load_mooncake(path)
        assert req.hash_ids == (0, 9) and req.timestamp == 5.0


def test_malformed_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n{}\n'
    )
    with pytest.raises(ValueError, match="line 2"):
        load_mooncake(path)


def test_block_keys_are_distinct_64_bit() -> None:
    ids = range(200_000)
    keys = {trace_block_key(h) for h in ids}
    assert len(keys) == len(ids)
    assert max(keys) > 1 << 60


def test_plan_publishes_each_pair_once_with_parents() -> None:
    trace = load_mooncake(limit=2000)
    instances = make_instances(4)
    plan = plan_publish(trace, instances, requests_per_batch=3)
    seen: set[tuple[str, int]] = set()
    for worker, batches in plan.batches.items():
        assert [b.batch.sequence for b in batches] == list(range(1, len(batches) + 1))
        held: set[int] = set()
        for b in batches:
            assert b.batch.instance.worker_id == worker
            for ev in b.batch.events:
                st = ev.stored
                assert list(st.block_keys) == [trace_block_key(h) for h in st.block_hashes]
                if st.HasField("parent_block_hash"):
                    assert st.parent_block_hash in held  # the chain is keyed
                else:
                    assert st.block_hashes[0] == 0
                for h in st.block_hashes:
                    assert (worker, h) not in seen
                    seen.add((worker, h))
                held.update(st.block_hashes)
    assert plan.blocks == len(seen)
    # Every instance that served a request holds the shared block 0.
    assert {w for w, h in seen if h == 0} == set(plan.batches)


def test_prompts_cut_and_extend() -> None:
    trace = load_mooncake(limit=3000)
    p32 = sample_prompts(trace, 32, 10)
    assert len(p32) == 10 and all(len(p) == 32 for p in p32)
    p256 = sample_prompts(trace, 256, 4)
    assert all(len(p) == 256 for p in p256)
    keys = prompt_keys((0, 1, 2), 5)
    assert keys[:3] == [trace_block_key(h) for h in (0, 1, 2)]
    assert len(set(keys)) == 5
