"""Sequence numbers over the whole uint64 range: every backend agrees with the memory one.

The API accepts any unsigned 64-bit sequence. Above 2^53 a double can no longer
tell neighbours apart, so the Redis scripts must compare sequences exactly
(KEYS.md, "Sequence numbers"). Each case runs on the memory backend, a
standalone Redis and a Redis Cluster (the ``index`` fixture of tests/conftest.py)
and checks the outcomes the contract (indexer/index.py) defines.
"""

from __future__ import annotations

from typing import Any

import pytest

from indexer.model import BatchOutcome, BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace

NS = Namespace("m")
W = InstanceId("w", 0)
TOP = (1 << 64) - 1
D = BatchOutcome.DUPLICATE
OK = BatchOutcome.APPLIED
GAP = BatchOutcome.APPLIED_AFTER_GAP


def store(key: int) -> BlockStored:
    return BlockStored(block_hashes=(key,), block_keys=(key,))


async def outcomes(index: Any, seqs: list[int]) -> list[tuple[BatchOutcome, int, bool]]:
    """Apply one single-block batch per sequence; return (outcome, applied, stale) each."""
    await index.register(InstanceSpec(W, "m", "http://w", 600.0))
    out = []
    for i, seq in enumerate(seqs):
        r = await index.apply(EventBatch(W, seq, (store(1000 + i),)))
        out.append((r.outcome, r.applied_sequence, r.stale))
    return out


@pytest.mark.parametrize(
    ("seqs", "want"),
    [
        # Neighbours above 2^53: a double rounds 2^53 + 1 down to 2^53.
        ([1 << 53, (1 << 53) + 1], [OK, OK]),
        ([(1 << 53) + 1, 1 << 53], [OK, D]),
        ([(1 << 53) + 2, (1 << 53) + 3, (1 << 53) + 3], [OK, OK, D]),
        # The gap test is exact too: 2^53 + 1 after 2^53 - 1 skips 2^53.
        ([(1 << 53) - 1, (1 << 53) + 1], [OK, GAP]),
        # The top of the range, and numbers of different lengths.
        ([TOP - 2, TOP - 1, TOP], [OK, OK, OK]),
        ([TOP - 1, TOP - 2], [OK, D]),
        ([TOP - 3, TOP - 1], [OK, GAP]),
        ([9, 10, 99, 100], [OK, OK, GAP, OK]),
        ([10**19, 10**19 - 1, 10**19 + 1], [OK, D, OK]),
        ([0, 1, 0], [OK, OK, D]),
    ],
)
async def test_sequences_compare_exactly(
    index: Any, seqs: list[int], want: list[BatchOutcome]
) -> None:
    got = await outcomes(index, seqs)
    assert [g[0] for g in got] == want
    applied, gapped = None, False
    for (outcome, seq_applied, stale), seq in zip(got, seqs, strict=True):
        if outcome is not D:
            applied = seq
        gapped = gapped or outcome is GAP
        assert seq_applied == applied  # a duplicate reports the last applied one
        assert stale == gapped  # a gap marks the instance stale; nothing here clears it
    states = {s.spec.instance: s for s in await index.list_instances()}
    assert states[W].applied_sequence == max(seqs)


async def test_duplicate_above_2_53_changes_nothing(index: Any) -> None:
    """A batch at or below the last sequence stores nothing, however close the numbers."""
    big = (1 << 60) + 7
    await index.register(InstanceSpec(W, "m", "http://w", 600.0))
    await index.apply(EventBatch(W, big, (store(1),)))
    r = await index.apply(EventBatch(W, big - 1, (store(2),)))
    assert (r.outcome, r.applied_sequence) == (D, big)
    assert [m.depth for m in await index.match(NS, [2])] == []
    r = await index.apply(EventBatch(W, big + 1, (store(3),)))
    assert (r.outcome, r.applied_sequence, r.stale) == (OK, big + 1, False)
    assert [m.depth for m in await index.match(NS, [3])] == [1]
