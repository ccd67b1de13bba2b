"""The harness's own parts: its model agrees with the contract's reference, its lag
rules say what CONSISTENCY.md says, its schedule replays exactly."""

from __future__ import annotations

import math
import random

import pytest

from indexer.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    Namespace,
    Tier,
)
from kvmesh.errors import KvmeshError
from lab.faults.model import GONE, History, Identity, IndexModel
from lab.faults.ops import (
    BLOCK_SIZE,
    CHAIN_BLOCKS,
    CHAINS,
    INSTANCES,
    PROFILES,
    chain_tokens,
    content_keys,
    ehash,
    generate,
    take,
)
from tests.conftest import FakeClock
from tests.contract.reference import ReferenceIndex

A, B = InstanceId("a", 0), InstanceId("b", 0)


def _event(rng: random.Random, model: str) -> object:
    c = rng.randrange(CHAINS)
    lora = rng.choice(("", "l"))
    x = rng.random()
    if x < 0.1:
        return AllBlocksCleared()
    if x < 0.35:
        blocks = [rng.randrange(CHAIN_BLOCKS + 1) for _ in range(rng.randint(1, 3))]
        tier = rng.choice((None, Tier.GPU, Tier.CPU))
        return BlockRemoved(tuple(ehash("g", c, j, lora) for j in blocks), tier)
    lo = rng.randrange(CHAIN_BLOCKS)
    hi = min(CHAIN_BLOCKS, lo + rng.randint(1, 3))
    hashes = tuple(ehash("g", c, j, lora) for j in range(lo, hi))
    parent = ehash("g", c, lo - 1, lora) if lo and rng.random() < 0.9 else None
    tier = rng.choice((Tier.GPU, Tier.CPU, Tier.DISK))
    if rng.random() < 0.2:
        keys = tuple(content_keys(c, hi, model, lora)[lo:hi])
        return BlockStored(hashes, parent, (), 0, lora, tier, keys)
    tokens = tuple(chain_tokens(c, hi)[lo * BLOCK_SIZE :])
    return BlockStored(hashes, parent, tokens, BLOCK_SIZE, lora, tier)


@pytest.mark.parametrize("seed", range(20))
def test_model_agrees_with_the_contract_reference(seed: int) -> None:
    """Same results and same content as tests/contract/reference.py on random operations."""
    rng = random.Random(seed)
    clock = FakeClock()
    ref = ReferenceIndex(clock)
    mine = IndexModel()
    seqs: dict[InstanceId, int] = {}
    models: dict[InstanceId, str] = {}
    for _ in range(300):
        iid = rng.choice(INSTANCES)
        x = rng.random()
        got: object
        want: object
        if x < 0.15:
            model = rng.choice(("m", "m", "m2"))
            models[iid] = model
            spec = InstanceSpec(
                iid, model, f"http://{iid}", rng.choice((5.0, 20.0)), rng.choice("ab")
            )
            want, got = ref.register(spec), mine.register(spec, clock())
        elif x < 0.6:
            seq = max(0, seqs.get(iid, -1) + rng.choice((1, 1, 1, 0, 2)))
            seqs[iid] = max(seq, seqs.get(iid, -1))
            model = models.get(iid, "m")
            evs = tuple(_event(rng, model) for _ in range(rng.randint(1, 3)))
            batch = EventBatch(iid, seq, evs)  # type: ignore[arg-type]
            try:
                want = ref.apply(batch)
            except KvmeshError as e:
                want = type(e)
            try:
                got = mine.apply(batch, clock())
            except KvmeshError as e:
                got = type(e)
        elif x < 0.7:
            try:
                want = ref.heartbeat(iid)
            except KvmeshError as e:
                want = type(e)
            try:
                got = mine.heartbeat(iid, clock())
            except KvmeshError as e:
                got = type(e)
        elif x < 0.75:
            try:
                want = ref.remove_instance(iid)
            except KvmeshError as e:
                want = type(e)
            try:
                got = mine.remove(iid)
            except KvmeshError as e:
                got = type(e)
        elif x < 0.8:
            want, got = ref.reap_expired(), mine.reap(clock())
        elif x < 0.85:
            clock.advance(rng.choice((1.0, 6.0, 21.0)))
            continue
        else:
            ns = Namespace(rng.choice(("m", "m2")), rng.choice(("", "l")))
            keys = content_keys(rng.randrange(CHAINS), rng.randint(1, CHAIN_BLOCKS), *ns)
            stale = rng.random() < 0.5
            want, got = ref.match(ns, keys, stale), mine.match(ns, keys, clock(), stale)
        assert got == want
        assert mine.blocks() == {ns: t for ns, t in ref.dump().blocks.items() if t}


def test_lag_window_and_own_writes() -> None:
    h = History()
    live = Identity(True, "old", False, 100.0)
    moved = Identity(True, "new", False, 100.0)
    h.note(A, live, sent=1.0, acked=1.1, writer=0)
    h.note(A, moved, sent=2.0, acked=2.1, writer=1, wrote=frozenset({"address"}))
    lag = 0.5
    # Replica 0 may still answer the old address until lag seconds after the ack...
    assert {i.address for i in h.admissible(A, 0, 2.2, 2.3, lag, "address")} == {"old", "new"}
    # ...not after,
    assert {i.address for i in h.admissible(A, 0, 2.7, 2.8, lag, "address")} == {"new"}
    # and never the replica that wrote the new one.
    assert {i.address for i in h.admissible(A, 1, 2.2, 2.3, lag, "address")} == {"new"}
    # Its own writes are per attribute: a batch of replica 0 does not refresh an address.
    h.note(A, moved, sent=2.15, acked=2.16, writer=0, wrote=frozenset({"life", "stale"}))
    assert {i.address for i in h.admissible(A, 0, 2.2, 2.3, lag, "address")} == {"old", "new"}


def test_new_instances_are_visible_at_once_removals_within_the_bound() -> None:
    h = History()
    h.note(B, Identity(True, "x", False, 100.0), sent=1.0, acked=1.1, writer=0)
    assert h.admissible(B, 1, 1.2, 1.3, 0.5, "life") == [Identity(True, "x", False, 100.0)]
    h.note(B, GONE, sent=2.0, acked=2.1, writer=0)
    assert GONE in h.admissible(B, 1, 2.2, 2.3, 0.5, "life")
    assert Identity(True, "x", False, 100.0) in h.admissible(B, 1, 2.2, 2.3, 0.5, "life")
    assert h.admissible(B, 1, 3.0, 3.1, 0.5, "life") == [GONE]
    assert not GONE.visible(0.0, True)
    assert Identity(True, "x", True, 10.0).visible(5.0, True)
    assert not Identity(True, "x", True, 10.0).visible(5.0, False)
    assert not Identity(True, "x", False, 10.0).visible(10.0, True)
    assert math.isinf(h.versions[B][-1].end)


@pytest.mark.parametrize("target", ["memory", "standalone", "cluster"])
def test_a_seed_names_one_sequence(target: str) -> None:
    for profile in PROFILES:
        one = take(7, profile, target, 2, 150)
        assert one == take(7, profile, target, 2, 150)
        assert one != take(8, profile, target, 2, 150)
        # A prefix of a longer run is the shorter run: --duration and --keep agree.
        assert take(7, profile, target, 2, 300)[:150] == one


def test_profiles_leave_out_what_a_target_cannot_do() -> None:
    kinds = {type(op).__name__ for op in take(3, "all", "memory", 1, 2000)}
    assert not kinds & {"Pause", "RestartRedis", "Migrate", "Failover"}
    kinds = {type(op).__name__ for op in take(3, "all", "cluster", 2, 2000)}
    assert "RestartRedis" not in kinds and {"Migrate", "Failover", "During"} <= kinds
    with pytest.raises(ValueError):
        next(generate(1, "nope", "memory", 1))
