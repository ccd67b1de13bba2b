"""KV-cache groups (indexer/groups.py): the hybrid hit rule, and what reaches the index.

The hit rule is checked against a plain transcription of vLLM 0.33's
``HybridKVCacheCoordinator.find_longest_cache_hit`` with its full-attention,
sliding-window and Mamba finders (one hash unit = one block), on random
presence; a deliberately broken rule must fail the same comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import groups
from indexer.groups import GroupTracker
from indexer.logic import IndexerLogic
from indexer.memory import MemoryIndex
from indexer.model import (
    BlockExtras,
    BlockRemoved,
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    MatchQuery,
    Namespace,
)
from kvmesh.blockkeys import block_keys
from kvmesh.errors import InvalidArgument
from tests.integration.test_replicas_service import config

BS = 4
W = InstanceId("w", 0)


def vllm_hit(
    full: Sequence[bool], groups: Sequence[tuple[str, int, Sequence[bool]]], max_blocks: int
) -> int:
    """vLLM's fixed point, transcribed: full attention, then each other group, repeated."""
    hit = max_blocks
    while True:
        cur = hit
        d = 0
        while d < cur and full[d]:
            d += 1
        cur = d
        for kind, window, held in groups:
            if kind == "mamba":
                found = 0
                for i in range(cur - 1, -1, -1):
                    if held[i]:
                        found = i + 1
                        break
                cur = found
            else:
                need = -(-(window - 1) // BS)
                run, found, match = 0, 0, False
                for i in range(cur - 1, -1, -1):
                    if held[i]:
                        run += 1
                        if run >= need:
                            found, match = i + need, True
                            break
                    else:
                        run = 0
                cur = found if match else run
        if cur == hit:
            return hit
        hit = cur


def _broken_hit(
    full: Sequence[bool], groups: Sequence[tuple[str, int, Sequence[bool]]], max_blocks: int
) -> int:
    """A rule that always wants a whole window (vLLM takes a shorter run from block 0)."""
    d = 0
    while d < max_blocks and full[d]:
        d += 1
    for kind, window, held in groups:
        if kind == "mamba":
            while d and not held[d - 1]:
                d -= 1
        else:
            need = -(-(window - 1) // BS)
            while d and (d < need or not all(held[d - need : d])):
                d -= 1
    return d


def _tracker_hit(
    full: Sequence[bool], groups: Sequence[tuple[str, int, Sequence[bool]]], max_blocks: int
) -> int:
    """The tracker's answer for the same presence, fed as engine events."""
    n = len(full)
    tokens = list(range(n * BS))
    tracker = GroupTracker()
    events: list[BlockStored] = []
    hashes = tuple(range(1, n + 1))
    events.append(
        BlockStored(hashes, None, tuple(tokens), BS, group=0, group_kind="full_attention")
    )
    for g, (kind, window, held) in enumerate(groups, start=1):
        # The engine announces each group with its first store (an unrelated block).
        events.append(
            BlockStored(
                (10_000 + g,),
                None,
                tuple(range(100, 100 + BS)),
                BS,
                group=g,
                group_kind="mamba" if kind == "mamba" else "sliding_window",
                sliding_window=window,
            )
        )
        for i in range(n):
            if held[i]:
                events.append(
                    BlockStored(
                        (hashes[i],),
                        hashes[i - 1] if i else None,
                        tuple(tokens[i * BS : (i + 1) * BS]),
                        BS,
                        group=g,
                        group_kind="mamba" if kind == "mamba" else "sliding_window",
                        sliding_window=window,
                    )
                )
    f = tracker.filter(W, "m", events, BS)
    assert all(isinstance(e, BlockStored) and e.group == 0 for e in f.events)
    keys = block_keys(tokens, BS, "m")
    depth = 0
    while depth < max_blocks and full[depth]:
        depth += 1
    return tracker.cut(W, keys, depth, BS)


_presence = st.integers(min_value=1, max_value=24).flatmap(
    lambda n: st.tuples(
        st.lists(st.booleans(), min_size=n, max_size=n),
        st.lists(
            st.tuples(
                st.sampled_from(["sliding_window", "mamba"]),
                st.sampled_from([2, 5, 9, 17]),
                st.lists(st.booleans(), min_size=n, max_size=n),
            ),
            min_size=1,
            max_size=2,
        ),
        st.integers(min_value=0, max_value=n),
    )
)


def _agree(rule: Callable[..., int]) -> Callable[..., None]:
    @settings(max_examples=300, deadline=None)
    @given(_presence)
    def check(case: tuple[list[bool], list[tuple[str, int, list[bool]]], int]) -> None:
        full, groups, max_blocks = case
        assert rule(full, groups, max_blocks) == vllm_hit(full, groups, max_blocks)

    return check


def test_the_tracker_cuts_hits_as_vllm_does() -> None:
    _agree(_tracker_hit)()


def test_a_rule_without_the_fixed_point_is_caught() -> None:
    with pytest.raises(AssertionError):
        _agree(_broken_hit)()


def test_other_groups_never_reach_the_index_and_their_removals_count() -> None:
    tracker = GroupTracker()
    tokens = tuple(range(3 * BS))
    full = BlockStored((1, 2, 3), None, tokens, BS, group_kind="full_attention")
    swa = BlockStored(
        (1, 2, 3), None, tokens, BS, group=1, group_kind="sliding_window", sliding_window=9
    )
    f = tracker.filter(W, "m", [full, swa], BS)
    assert f.events == (full,)
    keys = block_keys(tokens, BS, "m")
    assert tracker.cut(W, keys, 3, BS) == 3
    f = tracker.filter(W, "m", [BlockRemoved((3,), None, group=1)], BS)
    assert f.events == ()  # the group's removal is not the full-attention block's
    # The window (ceil(8 / 4) = 2 blocks) now ends at block 2.
    assert tracker.cut(W, keys, 3, BS) == 2
    tracker.rollback(f)
    assert tracker.cut(W, keys, 3, BS) == 3


async def test_a_salted_or_multimodal_prompt_matches_only_its_own_blocks() -> None:
    """Extra keys reach the content keys on both sides: events and Match."""
    logic = IndexerLogic(MemoryIndex(), config())
    await logic.register(InstanceSpec(W, "m", "http://w", 30.0, "x"))
    tokens = tuple(range(3 * BS))
    # An image on tokens 6..9: 2 tokens into block 1, and 2 tokens before block 2.
    salted = (
        BlockExtras(salt="tenant-a"),
        BlockExtras(media=(("img", 2),)),
        BlockExtras(media=(("img", -2),)),
    )
    await logic.publish(
        EventBatch(W, 0, (BlockStored((1, 2, 3), None, tokens, BS, extras=salted),))
    )

    async def depth(**kw: object) -> int:
        res = await logic.match(MatchQuery(Namespace("m"), token_ids=tokens, **kw))  # type: ignore[arg-type]
        return res.matches[0].depth if res.matches else 0

    assert await depth() == 0  # unsalted: another tenant's chain
    assert await depth(cache_salt="tenant-b") == 0
    assert await depth(cache_salt="tenant-a", media=(("img", 6, 4),)) == 3
    assert await depth(cache_salt="tenant-a", media=(("other", 6, 4),)) == 1
    assert await depth(cache_salt="tenant-a", media=(("img", 5, 4),)) == 1  # moved by one
    assert await depth(cache_salt="tenant-a") == 1


async def test_media_out_of_prompt_order_or_outside_the_prompt_name_the_item() -> None:
    logic = IndexerLogic(MemoryIndex(), config())
    tokens = tuple(range(3 * BS))
    for media, field in (
        ((("a", 6, 2), ("b", 2, 2)), "media[1].offset"),
        ((("a", 10, 4),), "media[0].offset"),
        ((("", 0, 1),), "media[0].identifier"),
    ):
        with pytest.raises(InvalidArgument) as e:
            await logic.match(MatchQuery(Namespace("m"), token_ids=tokens, media=media))
        assert e.value.field == field


# -- what the tracker remembers --------------------------------------------------


def _chain(first: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Hashes and tokens of ``n`` blocks of a chain of its own (hashes from ``first``)."""
    return tuple(range(first, first + n)), tuple(range(first * BS, (first + n) * BS))


def test_what_every_group_removed_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid engine stores and evicts for days: the engine hashes the tracker keeps
    (to key the other groups' events) go with the last group and copy holding them,
    so its memory follows what the engine holds, not what it ever stored."""
    monkeypatch.setattr(groups, "RECENT_KEYS", 100)
    tracker = GroupTracker()
    for cycle in range(50):
        hashes, tokens = _chain(1000 * (cycle + 1), 8)
        tracker.filter(
            W,
            "m",
            [
                BlockStored(hashes, None, tokens, BS, group=0, group_kind="full_attention"),
                BlockStored(hashes[-1:], hashes[-2], tokens[-BS:], BS, group=1, group_kind="mamba"),
            ],
            BS,
        )
        tracker.filter(
            W,
            "m",
            [BlockRemoved(hashes[-1:], group=1), BlockRemoved(hashes, group=0)],
            BS,
        )
    # Held: none. Recent (a later tail may name one as its parent): the newest 100.
    assert tracker.remembered(W) == (0, 100)


def test_a_hash_another_group_or_copy_holds_stays_known() -> None:
    """Removed from full attention once of two copies: the remaining copy still keys a
    state the Mamba group stores later; the hashes go with the last copy and group."""
    tracker = GroupTracker()
    hashes, tokens = _chain(1, 4)
    full = BlockStored(hashes, None, tokens, BS, group=0, group_kind="full_attention")
    state = BlockStored(
        hashes[1:2], hashes[0], tokens[BS : 2 * BS], BS, group=1, group_kind="mamba"
    )
    tracker.filter(W, "m", [full, full, state], BS)  # two physical copies (n > 1 samples)
    tracker.filter(W, "m", [BlockRemoved(hashes, group=0)], BS)
    assert tracker.remembered(W)[0] == 4
    child = BlockStored(
        (9,), hashes[-1], tuple(range(90, 90 + BS)), BS, group=1, group_kind="mamba"
    )
    f = tracker.filter(W, "m", [child], BS)
    assert f.skipped == {}  # keyed through its parent's remaining copy
    assert tracker.remembered(W)[0] == 5
    tracker.filter(W, "m", [BlockRemoved(hashes, group=0)], BS)
    assert tracker.remembered(W)[0] == 2  # the two Mamba states
    tracker.filter(W, "m", [BlockRemoved((hashes[1], 9), group=1)], BS)
    assert tracker.remembered(W)[0] == 0
    # A rolled-back batch gives back what it counted.
    f = tracker.filter(W, "m", [full], BS)
    assert tracker.remembered(W)[0] == 4
    tracker.rollback(f)
    assert tracker.remembered(W)[0] == 0
