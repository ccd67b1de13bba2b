"""Cluster: blocks with precomputed keys placed after a parent that later moves are lost to Match.

Found by the fault harness (``kvmesh bench faults --target cluster --profile
core --replicas 3 --seed 236``, shrunk to ``--keep 113,114,134,145,149``):
``ack_lost``, a Match by the chain's keys answering depth 3 where the
instance holds 8 blocks.

The Cluster layout (indexer/redis/KEYS.md, "Redis Cluster") places a block by
its chain position, which ``capply.lua`` derives from the parent's location in
``k:<id>``. A ``BlockStored`` with precomputed ``block_keys`` whose parent
engine hash the instance maps to a key at *another* position (here: that hash
was first stored as the start of a prompt, with keys of a chain of its own)
is placed at the parent's position + 1, not where its own keys belong. The
index contract (indexer/index.py) keys such blocks by ``block_keys`` and lets
a later store re-key the parent hash (the mapping moves, "a hash already
mapped to another key is first removed"); the children stay at the place
derived from the old one, under another anchor tag than a Match of their keys
reads, and the namespace has no unplaced copies to fall back on. Memory and
standalone Redis hold no positions and answer the full depth.

No real engine sends this: its hash covers the whole prefix, so blocks that
start a prompt never share a hash with the same tokens deeper in a chain. The
harness did (``Store(parent="none")`` with ``lo > 0`` reused the chain's
hashes); it now hashes such blocks apart, as an engine would, and
indexer/redis/KEYS.md states what the Cluster layout assumes of engine
hashes. This script is the one the harness found; with the harness as it is,
it must pass on every target.
"""

from __future__ import annotations

import pytest

from indexer.model import InstanceId
from lab.faults.driver import RunParams, format_round, run_round
from lab.faults.faults import Target
from lab.faults.ops import Match, Publish, Register, Store

W2 = InstanceId("w2", 0)

# Chains 1 and 2 share their first 3 blocks (lab/faults/ops.py, SHARED_WITH_CHAIN0),
# so block 2 of both has one engine hash.
SCRIPT = (
    Register(1, W2, "m", "http://w2-0:8000", 60.0, "a"),
    # Block 2 of chain 1 as the start of a prompt: its hash maps to depth 0.
    Publish(0, W2, "next", (Store(1, 2, 3, keys=True, parent="none"),)),
    # Blocks 3 and 4 of chain 2 by their content keys, after that hash.
    Publish(1, W2, "next", (Store(2, 3, 5, keys=True, parent="chain"),)),
    # Blocks 0..2 of chain 2 from the prompt's start: the hash of block 2 moves.
    Publish(1, W2, "next", (Store(2, 0, 3),)),
    Match(2, "m", "", 2, 5, by_keys=True, via="logic"),
)


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
async def test_blocks_after_a_re_keyed_parent_stay_matchable(
    kind: str, request: pytest.FixtureRequest
) -> None:
    target: Target = request.getfixturevalue(kind)
    res = await run_round(target, RunParams(profile="core", replicas=3, script=SCRIPT))
    assert not res.violations, format_round(res)
    assert res.operations == len(SCRIPT)
