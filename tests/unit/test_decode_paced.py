"""decode_batch_paced: the batch decode_batch gives, an event at a time.

The paced decoder splits a frame into its events (left encoded) and decodes
them one by one, awaiting ``pace()`` between two. It must give what
:func:`decode_batch` gives for every payload, the errors included: checked on
hand-picked frames and on random ones (Hypothesis), with a decoder broken on
purpose that the comparison must catch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.kvevents import decode
from indexer.kvevents.decode import DecodedBatch, MalformedFrame, decode_batch, decode_batch_paced
from indexer.pacing import Pacer


def stored(hashes: list[int], tokens: list[int], **kw: object) -> dict[str, object]:
    ev: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    ev.update(kw)
    return ev


async def _nothing() -> None:
    return None


def _outcome(
    decoder: Callable[[bytes], DecodedBatch | Awaitable[DecodedBatch]], payload: bytes
) -> tuple[str, Any]:
    """What a decoder makes of ``payload``: ('ok', batch) or ('error', message)."""
    try:
        got = decoder(payload)
        if asyncio.iscoroutine(got):
            got = asyncio.run(got)
        return "ok", got
    except MalformedFrame as e:
        return "error", str(e)


def _paced(payload: bytes) -> Awaitable[DecodedBatch]:
    return decode_batch_paced(payload, _nothing)


def _same(payload: bytes, decoder: Callable[[bytes], Any] = _paced) -> None:
    assert _outcome(decoder, payload) == _outcome(decode_batch, payload)


EVENTS = [
    stored([11, 12], list(range(8))),
    stored([13], [9, 9, 9, 9], parent_block_hash=12, medium="CPU"),
    ["BlockStored", [21, 22], None, list(range(8)), 4, None, "GPU", None],
    {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
    ["BlockRemoved", [b"\x00" * 24 + b"\x01" * 8], None],
    {"type": "AllBlocksCleared"},
    {"type": "Unknown"},
    ["BlockStored", "not-a-list"],
    stored([1.5], [1, 2, 3, 4]),  # type: ignore[list-item]
    42,
]

PAYLOADS = [
    msgpack.packb({"ts": 1.5, "events": EVENTS, "data_parallel_rank": 3}),
    msgpack.packb({"ts": 2, "events": EVENTS[:3], "attn_dp_rank": 1}),
    msgpack.packb({"ts": 2, "events": EVENTS, "data_parallel_rank": "x"}),
    msgpack.packb([1.0, EVENTS]),
    msgpack.packb([1.0, EVENTS, 0]),
    msgpack.packb([1.0, [], 0]),
    msgpack.packb({"ts": 1.0, "events": []}),
    msgpack.packb({1: 2, "ts": 1.0, "events": EVENTS}),  # a key that is not a string
    # a rank of nil is the rank, not a reason to read attn_dp_rank
    msgpack.packb({"ts": 1, "events": EVENTS[:2], "data_parallel_rank": None, "attn_dp_rank": 2}),
    msgpack.packb([1.0, EVENTS[:2], 1, "more"]),  # an array form with a fourth item
    # frames that are not batches
    b"\xc1",
    msgpack.packb(5),
    msgpack.packb([1.0]),
    msgpack.packb(["x", []]),
    msgpack.packb([1.0, {"a": 1}]),
    msgpack.packb({"events": []}),
    msgpack.packb({"ts": True, "events": []}),
    msgpack.packb([1.0, EVENTS]) + b"\x00",  # trailing bytes
    msgpack.packb([1.0, EVENTS])[:-3],  # cut short
]


@pytest.mark.parametrize("payload", PAYLOADS, ids=range(len(PAYLOADS)))
def test_the_paced_decoder_gives_what_decode_batch_gives(payload: bytes) -> None:
    _same(payload)


_JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)
_EVENT = st.one_of(
    st.builds(
        stored,
        st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=3),
        st.lists(st.integers(0, 2**31), max_size=12),
        block_size=st.sampled_from([4, 2, 0]),
        medium=st.sampled_from(["GPU", "cpu", "DISK", None, 3]),
    ),
    st.sampled_from(EVENTS),
    _JUNK,
)
_BATCH = st.one_of(
    st.builds(
        lambda ts, evs, rank: {"ts": ts, "events": evs, "data_parallel_rank": rank},
        st.floats(0, 1e9) | st.integers(0, 10) | st.just("x"),
        st.lists(_EVENT, max_size=5),
        st.none() | st.integers(0, 7),
    ),
    st.builds(lambda ts, evs: [ts, evs], st.floats(0, 1e9), st.lists(_EVENT, max_size=5)),
    _JUNK,
)


@settings(max_examples=300, deadline=None)
@given(_BATCH)
def test_random_frames_decode_alike(frame: Any) -> None:
    _same(msgpack.packb(frame))


def test_the_comparison_catches_a_decoder_that_loses_an_event() -> None:
    """The check above can fail: a paced decoder that drops a batch's last event."""

    async def lossy(payload: bytes) -> DecodedBatch:
        got = await decode_batch_paced(payload, _nothing)
        return DecodedBatch(got.timestamp, got.events[:-1], got.dp_rank, got.malformed_events)

    with pytest.raises(AssertionError):
        _same(PAYLOADS[0], lossy)


def test_the_comparison_catches_a_split_that_misreads_the_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """And one whose split names a rank the frame does not."""
    real = decode._split_batch

    def wrong(payload: bytes) -> Any:
        got = real(payload)
        return None if got is None else (got[0], 99, got[2])

    monkeypatch.setattr(decode, "_split_batch", wrong)
    with pytest.raises(AssertionError):
        _same(PAYLOADS[0])


async def test_the_loop_runs_between_two_events() -> None:
    """With the loop's own pacer (a budget of 0: every event spends it), another
    task gets turns while one batch decodes, between each two of its events."""
    pacer = Pacer(0.0)
    n = 12
    payload = msgpack.packb({"ts": 1.0, "events": [stored([i], [i] * 4) for i in range(n)]})
    turns = 0
    done = False

    async def other() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other())
    await asyncio.sleep(0)
    before = turns
    got = await decode_batch_paced(payload, pacer.pace)
    during = turns - before
    done = True
    await ticker
    assert len(got.events) == n
    assert during >= n - 1, during  # decode_batch itself would give none


async def test_a_long_event_gives_way_between_its_unpacking_and_its_reading() -> None:
    """One event of 16-token blocks holds up to 256 k token ids: unpacking it
    and reading it into an event are two steps, with a pace between them (a
    short event is one step)."""
    long_ids = list(range(decode.LONG_EVENT_BYTES))  # ids >= 128 take 2 bytes or more
    short = [stored([1], [1] * 4), stored([3], [3] * 4)]
    paces = 0

    async def pace() -> None:
        nonlocal paces
        paces += 1
        await asyncio.sleep(0)

    payload = msgpack.packb({"ts": 1.0, "events": [short[0], stored([2], long_ids), short[1]]})
    got = await decode_batch_paced(payload, pace)
    assert got == decode_batch(payload)
    assert paces == 3  # two between the events, one inside the long one
    paces = 0
    payload = msgpack.packb({"ts": 1.0, "events": [short[0], stored([2], [2] * 4), short[1]]})
    assert (await decode_batch_paced(payload, pace)) == decode_batch(payload)
    assert paces == 2
