"""A follower's in-process answers (router_client/follower.py): made once, never stale.

The follower keeps whole answers by the identities of its copy's hits (the
copy keeps its hits made, so a prompt asked again gives the same objects).
These tests check that an answer is never served after the copy's hits
changed, and that a caller changing the answer it was given changes nothing
for the next caller. The copy is a real MemoryIndex; no stream is needed.
"""

from __future__ import annotations

from indexer.memory import MemoryIndex
from indexer.model import BlockRemoved, BlockStored, EventBatch, InstanceId, InstanceSpec
from kvmesh.blockkeys import block_keys
from router_client.follower import IndexFollower

BS = 4
PROMPT = list(range(100, 116))  # 4 blocks of 4
KEYS = block_keys(PROMPT, BS, "llama")
A, B = InstanceId("a", 0), InstanceId("b", 0)


async def _follower() -> tuple[IndexFollower, MemoryIndex]:
    index = MemoryIndex()
    for iid in (A, B):
        await index.register(InstanceSpec(iid, "llama", f"http://{iid.worker_id}", 60.0))
        ev = BlockStored(block_hashes=(1, 2, 3, 4), token_ids=tuple(PROMPT), block_size=BS)
        await index.apply(EventBatch(iid, 0, (ev,)))
    f = IndexFollower("127.0.0.1:1")  # never started: its copy is set by hand
    f.index = index
    f.synced = True
    return f, index


def _depths(f: IndexFollower) -> dict[str, int]:
    out = f.match("llama", "", KEYS)
    assert out is not None and out.ok
    return {name: m.depth for name, m in out.matches.items()}


async def test_an_answer_asked_again_follows_the_copy() -> None:
    f, index = await _follower()
    assert _depths(f) == {"a": 4, "b": 4}
    assert _depths(f) == {"a": 4, "b": 4}  # made once, given again
    await index.apply(EventBatch(A, 1, (BlockRemoved(block_hashes=(3,)),)))
    assert _depths(f) == {"a": 2, "b": 4}
    await index.remove_instance(B)
    assert _depths(f) == {"a": 2}


async def test_a_caller_that_changes_its_answer_changes_nothing_for_the_next() -> None:
    f, _ = await _follower()
    out = f.match("llama", "", KEYS)
    assert out is not None
    out.matches.clear()
    assert _depths(f) == {"a": 4, "b": 4}
