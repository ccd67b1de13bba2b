"""Hits that end inside a block: a hash unit finer than the block (indexer/groups.py).

vLLM 0.33 with full attention and a Mamba group in ``align`` mode, blocks of
64 tokens and a ``hash_block_size`` of 16, reuses a prefix that ends on any
16-token boundary: whole blocks the full-attention group holds, then the
last 16-token unit of the next block it holds a partial entry for, then back
to the last unit whose Mamba state the Mamba group holds. Its events publish
such entries as ``BlockStored`` with ``block_size`` 16, one hash, the unit's
16 tokens and the previous unit's hash as parent.

The rule is checked against a plain transcription of vLLM's fine-grained
finders (phase 1 and 2 of the full-attention finder, the Mamba finder at
hash-unit granularity, the coordinator's fixed point) on random presence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.enginehash import EngineHasher, unit_extras
from indexer.groups import GroupTracker, Prompt
from indexer.kvevents.decode import decode_batch
from indexer.logic import IndexerLogic
from indexer.memory import MemoryIndex
from indexer.model import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    MatchQuery,
    Namespace,
)
from kvmesh.blockkeys import block_keys, namespace_seed
from tests.integration.test_replicas_service import config

W = InstanceId("w", 0)
FULL, MAMBA = "full_attention", "mamba"


def _h(unit: int) -> int:
    """The engine hash of the prefix that ends with hash unit ``unit`` (1-based)."""
    return 1_000_000 + unit


# -- a case of the conformance run, at its sizes ---------------------------------

B, U = 64, 16
#: The prompt of the request that left the state: its tail boundary is
#: (660 - 1) // 16 * 16 = 656 tokens, unit 41, one unit into block 11.
PROMPT_A = tuple(range(100, 760))


def _events_of_a() -> tuple[BlockStored, ...]:
    """What vLLM publishes once the request's prefill is done (chunks end at 640 and 656)."""
    a = PROMPT_A
    return (
        BlockStored(
            tuple(_h(4 * j) for j in range(1, 11)), None, a[:640], B, group=0, group_kind=FULL
        ),
        # The full-attention group's partial entry at the prompt's last unit boundary.
        BlockStored((_h(41),), _h(40), a[640:656], U, group=0, group_kind=FULL),
        # The Mamba group's state at block 10 and at the tail boundary.
        BlockStored((_h(40),), _h(36), a[576:640], B, group=1, group_kind=MAMBA),
        BlockStored((_h(41),), _h(40), a[640:656], U, group=1, group_kind=MAMBA),
    )


async def _logic_with(events: Sequence[BlockStored | BlockRemoved]) -> IndexerLogic:
    logic = IndexerLogic(MemoryIndex(), config(block_size=B))
    await logic.register(InstanceSpec(W, "m", "http://w", 30.0, "x"))
    await logic.publish(EventBatch(W, 0, tuple(events)))
    return logic


async def _hit(logic: IndexerLogic, tokens: Sequence[int]) -> tuple[int, int]:
    """(depth, tokens) Match gives the instance; (0, 0) when it is not listed."""
    res = await logic.match(MatchQuery(Namespace("m"), token_ids=tokens))
    for m in res.matches:
        if m.instance == W:
            return m.depth, m.tokens or m.depth * res.block_size
    return 0, 0


async def test_a_mamba_state_one_unit_into_a_block_is_the_hit() -> None:
    # Request i0-r51 of the conformance run: 705 tokens, vLLM reuses 656.
    logic = await _logic_with(_events_of_a())
    follow_up = PROMPT_A + tuple(range(5000, 5045))
    assert len(follow_up) == 705
    assert await _hit(logic, follow_up) == (10, 656)
    # Neither partial entry reached the index as a block, nor was it skipped.
    assert logic.counters.events_skipped == {}


async def test_a_prompt_that_ends_before_the_unit_stops_at_the_block_state() -> None:
    logic = await _logic_with(_events_of_a())
    # 656 tokens: vLLM looks at 655 at most, so unit 41 is out of reach;
    # Mamba then holds block 10.
    assert await _hit(logic, PROMPT_A[:656]) == (10, 640)
    # The same prompt diverging inside unit 41.
    other = PROMPT_A[:650] + tuple(range(9000, 9060))
    assert await _hit(logic, other) == (10, 640)


async def test_the_partial_entry_goes_when_its_block_is_promoted() -> None:
    """vLLM drops a block's partial entry when the block becomes full (decode)."""
    logic = await _logic_with(_events_of_a())
    seq = PROMPT_A + tuple(range(5000, 5004))  # 664 tokens: block 11 is not full yet
    full11 = BlockStored((_h(44),), _h(40), (seq + tuple(range(7000, 7100)))[640:704], B)
    await logic.publish(
        EventBatch(
            W,
            1,
            (BlockRemoved((_h(41),), group=0), full11),
        )
    )
    prompt = (seq + tuple(range(7000, 7100)))[:720]
    # Full attention now holds 11 blocks; Mamba's rightmost state is still unit 41.
    assert await _hit(logic, prompt) == (10, 656)
    # The Mamba state goes too: back to block 10.
    await logic.publish(EventBatch(W, 2, (BlockRemoved((_h(41),), group=1),)))
    assert await _hit(logic, prompt) == (10, 640)


async def test_a_unit_whose_parent_was_never_published_is_skipped_not_guessed() -> None:
    """A tail two units into a block names the previous unit's hash as parent, which
    no event keyed: the entry cannot be keyed from tokens, so it is counted and left out
    (the hit is cut to what is known: under, never over)."""
    a = PROMPT_A + tuple(range(5000, 5045))  # a prompt of 675 tokens: its tail is unit 42
    events = (
        BlockStored(
            tuple(_h(4 * j) for j in range(1, 11)), None, a[:640], B, group=0, group_kind=FULL
        ),
        BlockStored((_h(42),), _h(41), a[656:672], U, group=0, group_kind=FULL),
        BlockStored((_h(40),), _h(36), a[576:640], B, group=1, group_kind=MAMBA),
        BlockStored((_h(42),), _h(41), a[656:672], U, group=1, group_kind=MAMBA),
    )
    logic = await _logic_with(events)
    assert await _hit(logic, (*a, 1, 2, 3)) == (10, 640)  # vLLM: 672
    assert logic.counters.events_skipped == {"partial_unplaced": 2}


def _vllm_events(
    a: tuple[int, ...], hasher: EngineHasher | None = None
) -> tuple[tuple[BlockStored, ...], list[int]]:
    """vLLM's events, with its real (sha256) hashes, for a prompt ``a`` whose tail is
    unit 42, two units into block 11; and the hash of each unit (index = unit - 1)."""
    hs, _ = (hasher or EngineHasher()).units(a, U, 42)
    events = (
        BlockStored(
            tuple(hs[4 * j - 1] for j in range(1, 11)), None, a[:640], B, group=0, group_kind=FULL
        ),
        BlockStored((hs[41],), hs[40], a[656:672], U, group=0, group_kind=FULL),
        BlockStored((hs[39],), hs[35], a[576:640], B, group=1, group_kind=MAMBA),
        BlockStored((hs[41],), hs[40], a[656:672], U, group=1, group_kind=MAMBA),
    )
    return events, hs


async def test_a_unit_whose_parent_was_never_published_is_found_by_vllms_hash() -> None:
    """The same tail with vLLM's real hashes: the prompt's own engine hashes reach the
    entry whose parent no event keyed, so the hit is vLLM's, inside block 11."""
    a = PROMPT_A + tuple(range(5000, 5045))
    events, hs = _vllm_events(a)
    logic = await _logic_with(events)
    assert await _hit(logic, (*a, 1, 2, 3)) == (10, 672)  # vLLM: 672
    # Still unkeyable from tokens: counted as such, kept by hash.
    assert logic.counters.events_skipped == {"partial_unplaced": 2}
    # A prompt that differs inside unit 41 (the unit no event carried) is not it.
    other = (*a[:650], 9, *a[651:], 1, 2, 3)
    assert await _hit(logic, other) == (10, 640)
    # Ends before the unit: vLLM looks at 671 tokens at most.
    assert await _hit(logic, a[:672]) == (10, 640)
    # The entries' removal (both groups) takes the hit back to block 10.
    await logic.publish(
        EventBatch(
            W,
            1,
            (BlockRemoved((hs[41],), group=0), BlockRemoved((hs[41],), group=1)),
        )
    )
    assert await _hit(logic, (*a, 1, 2, 3)) == (10, 640)


async def test_only_the_way_the_engine_hashes_finds_its_entries() -> None:
    """An engine with PYTHONHASHSEED hashes from another NONE_HASH: without its seed
    in the config nothing is found (under, never over); with it, the hit is vLLM's.
    A LoRA prompt (vLLM hashes the adapter's path) is never computed."""
    a = PROMPT_A + tuple(range(5000, 5045))
    events, _ = _vllm_events(a, EngineHasher("sha256", "123"))
    logic = await _logic_with(events)
    assert await _hit(logic, (*a, 1, 2, 3)) == (10, 640)
    seeded = IndexerLogic(
        MemoryIndex(), config(block_size=B, engine_events={"vllm_hash_seeds": ["123"]})
    )
    await seeded.register(InstanceSpec(W, "m", "http://w", 30.0, "x"))
    await seeded.publish(EventBatch(W, 0, events))
    assert await _hit(seeded, (*a, 1, 2, 3)) == (10, 672)

    tracker = GroupTracker()
    plain, _ = _vllm_events(a)
    tracker.filter(W, "m", plain, B)
    keys = block_keys((*a, 1, 2, 3), B, "m")
    prompt = Prompt(keys, B, tokens=(*a, 1, 2, 3), seed=namespace_seed("m", ""), limit=677)
    assert tracker.hit(W, prompt, 10) == 672
    lora = Prompt(
        keys, B, tokens=(*a, 1, 2, 3), seed=namespace_seed("m", ""), limit=677, lora_name="x"
    )
    assert tracker.hit(W, lora, 10) == 640


async def test_a_hit_inside_the_first_block_of_an_instance_holding_no_whole_block() -> None:
    """A short prompt's tail at unit 3 (parent unit 2, never published) is all the
    instance holds: the index lists it for no prompt, so the tracker adds it, found
    by vLLM's hash, with depth 0 (conformance run: vLLM 48 tokens, kvmesh 0)."""
    short = PROMPT_A[:50]
    hs, _ = EngineHasher().units(short, U, 3)
    events = (
        BlockStored((hs[2],), hs[1], short[32:48], U, group=0, group_kind=FULL),
        BlockStored((hs[2],), hs[1], short[32:48], U, group=1, group_kind=MAMBA),
    )
    logic = await _logic_with(events)
    assert await _hit(logic, (*short[:48], *range(5000, 5032))) == (0, 48)
    assert await _hit(logic, (*short[:48], 1, 2)) == (0, 48)  # shorter than a block
    assert await _hit(logic, (*short[:47], 1, 2, 3)) == (0, 0)  # differs in unit 3
    assert await _hit(logic, (9, *short[1:48], 1, 2)) == (0, 0)  # differs in unit 1
    assert await _hit(logic, short[:48]) == (0, 0)  # vLLM looks at 47 tokens at most
    # Gone from the fleet: not listed.
    await logic.remove_instance(W)
    assert await _hit(logic, (*short[:48], 1, 2)) == (0, 0)


async def test_the_ack_counts_the_blocks_the_group_tracker_left_out() -> None:
    """A publisher reads what was left out of its batch from the ack: the tracker's
    skips (here two unkeyable units) are in blocks_skipped like validation's."""
    a = PROMPT_A + tuple(range(5000, 5045))
    logic = IndexerLogic(MemoryIndex(), config(block_size=B))
    await logic.register(InstanceSpec(W, "m", "http://w", 30.0, "x"))
    ack = await logic.publish(
        EventBatch(
            W,
            0,
            (
                BlockStored(
                    tuple(_h(4 * j) for j in range(1, 11)),
                    None,
                    a[:640],
                    B,
                    group=0,
                    group_kind=FULL,
                ),
                BlockStored((_h(42),), _h(41), a[656:672], U, group=0, group_kind=FULL),
                BlockStored((_h(40),), _h(36), a[576:640], B, group=1, group_kind=MAMBA),
                BlockStored((_h(42),), _h(41), a[656:672], U, group=1, group_kind=MAMBA),
            ),
        )
    )
    assert ack.blocks_skipped == sum(logic.counters.events_skipped.values()) == 2


async def test_a_hit_inside_the_first_block_is_listed_with_depth_0() -> None:
    a = PROMPT_A
    events = (
        BlockStored((_h(4), _h(8)), None, a[:128], B, group=0, group_kind=FULL),
        BlockStored((_h(1),), None, a[:16], U, group=1, group_kind=MAMBA),
    )
    logic = await _logic_with(events)
    assert await _hit(logic, a[:200]) == (0, 16)


async def test_block_keys_give_whole_blocks_only() -> None:
    logic = await _logic_with(_events_of_a())
    keys = block_keys(PROMPT_A + tuple(range(5000, 5045)), B, "m")
    res = await logic.match(MatchQuery(Namespace("m"), block_keys=keys))
    assert [(m.depth, m.tokens) for m in res.matches] == [(10, 0)]


def _wire(ev: BlockStored, salt: str = "") -> dict[str, object]:
    """``ev`` as vLLM 0.33 publishes it (map encoding, sha256 hashes as bytes)."""
    return {
        "type": "BlockStored",
        "block_hashes": [h.to_bytes(32, "big") for h in ev.block_hashes],
        "parent_block_hash": None
        if ev.parent_block_hash is None
        else ev.parent_block_hash.to_bytes(32, "big"),
        "token_ids": list(ev.token_ids),
        "block_size": ev.block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        # The salt is an extra key of the chain's first block (or unit) only.
        "extra_keys": [
            [salt] if salt and ev.parent_block_hash is None and i == 0 else None
            for i in range(len(ev.block_hashes))
        ],
        "group_idx": ev.group,
        "kv_cache_spec_kind": ev.group_kind,
        "kv_cache_spec_sliding_window": None,
        "session_id": None,
        "lookahead_token_ids": None,
    }


async def test_vllm_frames_of_a_salted_prompt_reach_the_same_units() -> None:
    """Decoded from vLLM's wire, with a cache_salt: the unit keys of events and Match agree."""
    a = PROMPT_A
    events = (
        BlockStored(
            tuple(_h(4 * j) for j in range(1, 11)), None, a[:640], B, group=0, group_kind=FULL
        ),
        BlockStored((_h(41),), _h(40), a[640:656], U, group=0, group_kind=FULL),
        BlockStored((_h(41),), _h(40), a[640:656], U, group=1, group_kind=MAMBA),
        # A short prompt's tail, inside the first block: the salt is its extra key.
        BlockStored((_h(1),), None, a[:16], U, group=0, group_kind=FULL),
        BlockStored((_h(1),), None, a[:16], U, group=1, group_kind=MAMBA),
    )
    payload = msgpack.packb(
        {"ts": 1.0, "events": [_wire(ev, "tenant-a") for ev in events]}, use_bin_type=True
    )
    batch = decode_batch(payload)
    assert batch.malformed_events == 0
    assert [(e.block_size, e.group) for e in batch.events if isinstance(e, BlockStored)] == [
        (B, 0),
        (U, 0),
        (U, 1),
        (U, 0),
        (U, 1),
    ]
    logic = IndexerLogic(MemoryIndex(), config(block_size=B))
    await logic.register(InstanceSpec(W, "m", "http://w", 30.0, "x"))
    await logic.publish(EventBatch(W, 0, batch.events))
    prompt = PROMPT_A + tuple(range(5000, 5045))

    async def hit(salt: str, tokens: Sequence[int] = prompt) -> tuple[int, int]:
        res = await logic.match(MatchQuery(Namespace("m"), token_ids=tokens, cache_salt=salt))
        return next(((m.depth, m.tokens) for m in res.matches), (0, 0))

    assert await hit("tenant-a") == (10, 656)
    assert await hit("tenant-b") == (0, 0)
    assert await hit("") == (0, 0)
    assert await hit("tenant-a", prompt[:100]) == (0, 16)  # inside the first block
    assert logic.counters.events_skipped == {}


def test_a_removal_naming_a_block_and_a_unit_passes_only_the_block() -> None:
    tracker = GroupTracker()
    tracker.filter(W, "m", _events_of_a(), B)
    f = tracker.filter(W, "m", [BlockRemoved((_h(41), _h(40), 12345), group=0)], B)
    assert f.events == (BlockRemoved((_h(40), 12345), group=0),)
    f = tracker.filter(W, "m", [BlockRemoved((_h(41),), group=0)], B)
    assert f.events == ()  # its last copy went with the first removal: nothing to pass


async def test_a_lookahead_unit_entry_is_skipped_as_lookahead() -> None:
    a = PROMPT_A
    events = (
        BlockStored((_h(4),), None, a[:64], B, group=0, group_kind=FULL),
        BlockStored((_h(5),), _h(4), a[64:80], U, group=0, group_kind=FULL, lookahead=True),
        BlockStored((_h(5),), _h(4), a[64:80], U, group=1, group_kind=MAMBA),
    )
    logic = await _logic_with(events)
    assert logic.counters.events_skipped == {"lookahead": 1}
    # Mamba holds unit 5, full attention only block 1: the hit is block 1's end,
    # where Mamba holds nothing.
    assert await _hit(logic, a[:100]) == (0, 0)


def test_rollback_forgets_the_units_a_batch_counted() -> None:
    tracker = GroupTracker()
    f = tracker.filter(W, "m", _events_of_a(), B)
    assert all(e.group == 0 and e.block_size == B for e in f.events if isinstance(e, BlockStored))
    prompt = PROMPT_A + tuple(range(5000, 5045))
    keys = block_keys(prompt, B, "m")
    view = Prompt(keys, B, tokens=prompt, seed=namespace_seed("m"))
    assert tracker.hit(W, view, 10) == 656
    tracker.rollback(f)
    assert tracker.hit(W, view, 10) == 10 * B  # nothing known: not hybrid any more


# -- the rule against a transcription of vLLM's, on random presence ---------------

PB, PU = 8, 2  # 4 hash units per block, as 64 / 16
S = PB // PU


def vllm_fine_hit(
    depth: int,
    fa_units: set[int],
    mamba: Sequence[set[int]],
    n_tokens: int,
) -> int:
    """vLLM's fine-grained lookup, transcribed: ``depth`` whole blocks held by full
    attention, its partial entries ``fa_units`` (units inside a block), each Mamba
    group's states (units, block ends included), a prompt of ``n_tokens``."""
    limit = n_tokens - 1
    n_units = n_tokens // PU
    # Full attention, phase 1: whole blocks up to the limit.
    f = min(depth, limit // PB)
    hit = f * PB
    # Phase 2: the highest partial entry inside the next block.
    first = f * S
    top = min(first + S - 1, limit // PU, n_units)
    for idx in range(top - 1, first - 1, -1):
        if idx + 1 in fa_units:
            hit = (idx + 1) * PU
            break
    # Every Mamba group: its rightmost state at or before the hit, to a fixed point.
    while True:
        start = hit
        for held in mamba:
            found = 0
            for idx in range(min(hit // PU, n_units) - 1, -1, -1):
                if idx + 1 in held:
                    found = (idx + 1) * PU
                    break
            hit = found
        if hit == start or len(mamba) == 1:
            return hit


def _tracker_fine_hit(
    depth: int,
    fa_units: set[int],
    mamba: Sequence[set[int]],
    n_tokens: int,
    total_blocks: int,
    unknown_parents: frozenset[int] = frozenset(),
    full_block_states: frozenset[int] = frozenset(),
) -> int:
    """The tracker fed the same presence as vLLM's events. ``unknown_parents``: units
    whose partial entries name a parent nothing keyed. ``full_block_states``: blocks
    whose Mamba state is published as a whole block rather than as a unit entry."""
    seq = tuple(range(10, 10 + total_blocks * PB))
    n_units = total_blocks * S
    events: list[BlockStored | BlockRemoved] = [
        BlockStored(
            tuple(_h(S * j) for j in range(1, total_blocks + 1)),
            None,
            seq,
            PB,
            group=0,
            group_kind=FULL,
        )
    ]

    def unit_entry(k: int, g: int, kind: str) -> BlockStored:
        parent = None if k == 1 else _h(k - 1)
        if k in unknown_parents:
            parent = 7  # a unit hash no event carried
        return BlockStored(
            (_h(k),), parent, seq[(k - 1) * PU : k * PU], PU, group=g, group_kind=kind
        )

    # Every interior unit is stored then (unless held) removed, in chain order,
    # so that each one's parent is known when it arrives.
    interior = [k for k in range(1, n_units + 1) if k % S]
    events += [unit_entry(k, 0, FULL) for k in interior]
    events += [BlockRemoved((_h(k),), group=0) for k in interior if k not in fa_units]
    for g, held in enumerate(mamba, start=1):
        for k in range(1, n_units + 1):
            if k % S == 0 and k // S in full_block_states:
                ev = BlockStored(
                    (_h(k),),
                    _h(k - S) if k > S else None,
                    seq[(k - S) * PU : k * PU],
                    PB,
                    group=g,
                    group_kind=MAMBA,
                )
                events.append(ev)
            else:
                events.append(unit_entry(k, g, MAMBA))
            if k not in held:
                events.append(BlockRemoved((_h(k),), group=g))
    tracker = GroupTracker()
    f = tracker.filter(W, "m", events, PB)
    assert all(
        isinstance(e, BlockStored) and e.group == 0 and e.block_size == PB
        for e in f.events
        if isinstance(e, BlockStored)
    )
    prompt = seq[:n_tokens]
    keys = block_keys(prompt, PB, "m")
    view = Prompt(keys, PB, tokens=prompt, seed=namespace_seed("m"), limit=n_tokens - 1)
    return tracker.hit(W, view, min(depth, len(keys)))


def _units(n: int, *, interior: bool = False) -> st.SearchStrategy[set[int]]:
    """A random half of units 1..n (inside blocks only when ``interior``)."""
    return st.lists(st.booleans(), min_size=n, max_size=n).map(
        lambda bits: {k for k, b in enumerate(bits, 1) if b and (k % S or not interior)}
    )


_fine = st.integers(min_value=1, max_value=6).flatmap(
    lambda nb: st.tuples(
        st.just(nb),
        st.integers(min_value=0, max_value=nb),
        _units(nb * S, interior=True),
        st.lists(_units(nb * S), min_size=1, max_size=2),
        st.integers(min_value=1, max_value=nb * PB),
        st.sets(st.integers(min_value=1, max_value=nb)),
    )
)


@settings(max_examples=400, deadline=None)
@given(_fine)
def test_the_tracker_finds_vllms_hit_inside_a_block(
    case: tuple[int, int, set[int], list[set[int]], int, set[int]],
) -> None:
    nb, depth, fa_units, mamba, n_tokens, whole = case
    depth = min(depth, n_tokens // PB)
    want = vllm_fine_hit(depth, fa_units, mamba, n_tokens)
    got = _tracker_fine_hit(
        depth, fa_units, mamba, n_tokens, nb, full_block_states=frozenset(whole)
    )
    assert got == want


@settings(max_examples=300, deadline=None)
@given(_fine, st.sets(st.integers(min_value=2, max_value=24)))
def test_units_it_cannot_key_only_ever_lower_the_hit(
    case: tuple[int, int, set[int], list[set[int]], int, set[int]], unknown: set[int]
) -> None:
    nb, depth, fa_units, mamba, n_tokens, _ = case
    depth = min(depth, n_tokens // PB)
    want = vllm_fine_hit(depth, fa_units, mamba, n_tokens)
    got = _tracker_fine_hit(
        depth, fa_units, mamba, n_tokens, nb, unknown_parents=frozenset(unknown)
    )
    assert got <= want
    assert got % PU == 0


def test_engine_hashes_are_computed_a_block_at_a_time_from_the_nearest_known_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prompt's engine hashes, asked in any order, are vLLM's chain; a second prompt
    with the same first blocks starts from the block ends the first one left."""
    hasher = EngineHasher()
    salt, media = "tenant", [("img", 70, 40)]
    a = tuple(range(100, 100 + 10 * B + 20))
    want, _ = hasher.units(a, U, len(a) // U, unit_extras(len(a) // U, U, salt, media))
    b = (*a[: 9 * B], *range(7000, 7100))  # the same first nine blocks
    want_b, _ = hasher.units(b, U, 38, unit_extras(38, U, salt, media))
    counted: list[int] = []
    real = EngineHasher.units

    def counting(self: EngineHasher, tokens: Any, unit: int, count: int, *args: Any) -> Any:
        start = args[1] if len(args) > 1 and args[1] is not None else (0, b"")
        counted.append(count - start[0])
        return real(self, tokens, unit, count, *args)

    monkeypatch.setattr(EngineHasher, "units", counting)
    ends: dict[int, bytes] = {}

    def prompt(tokens: tuple[int, ...]) -> Prompt:
        keys = block_keys(tokens, B, "m", cache_salt=salt, media=media)
        return Prompt(
            keys, B, tokens=tokens, seed=namespace_seed("m"), cache_salt=salt, media=media
        )

    first = prompt(a).engine_hashes(hasher, U, ends)
    assert first is not None and len(first) == len(want)
    order = [37, 3, 40, 0, 12, 39]
    assert [first[i] for i in order] == [want[i] for i in order]
    assert [first[i] for i in range(len(want))] == want
    assert sum(counted) == len(want)  # each unit hashed once
    counted.clear()
    second = prompt(b).engine_hashes(hasher, U, ends)
    assert second is not None
    assert second[9 * 4 + 1] == want_b[37]
    assert sum(counted) == 4  # block 9 alone, on from the end of block 8
