"""Decoding of vLLM / SGLang KV-event frames (both encodings), no network."""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped]
import pytest

from indexer.kvevents.decode import (
    MalformedFrame,
    decode_batch,
    decode_seq,
    engine_hash,
    medium_tier,
)
from indexer.model import AllBlocksCleared, BlockExtras, BlockRemoved, BlockStored, Tier

TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]


def stored_map(**kw: object) -> dict[str, object]:
    ev: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    ev.update(kw)
    return ev


def test_map_encoding_current_vllm() -> None:
    payload = msgpack.packb(
        {
            "ts": 12.5,
            "events": [
                stored_map(
                    extra_keys=None, group_idx=0, kv_cache_spec_kind="full_attention", new=1
                ),
                {"type": "BlockRemoved", "block_hashes": [12], "medium": "CPU", "group_idx": 0},
                {"type": "AllBlocksCleared"},
            ],
            "data_parallel_rank": 3,
        }
    )
    b = decode_batch(payload)
    assert (b.timestamp, b.dp_rank, b.malformed_events) == (12.5, 3, 0)
    assert b.events == (
        BlockStored(
            block_hashes=(11, 12),
            token_ids=tuple(TOKENS),
            block_size=4,
            tier=Tier.GPU,
            group_kind="full_attention",
        ),
        BlockRemoved(block_hashes=(12,), tier=Tier.CPU),
        AllBlocksCleared(),
    )


def test_array_encoding_older_vllm_and_sglang() -> None:
    payload = msgpack.packb(
        [
            1.0,
            [
                ["BlockStored", [21], 11, [9, 9, 9, 9], 4, 7],  # no medium: older publisher
                ["BlockStored", [22], 21, [8, 8, 8, 8], 4, None, "cpu_pinned", "sql", None, 2],
                ["BlockRemoved", [21]],
                ["AllBlocksCleared"],
            ],
        ]
    )
    b = decode_batch(payload, engine_hash_keys=True)
    assert b.dp_rank is None
    s1, s2, r, c = b.events
    assert s1 == BlockStored(
        block_hashes=(21,),
        parent_block_hash=11,
        token_ids=(9, 9, 9, 9),
        block_size=4,
        lora_name="7",  # lora_id only: its decimal form names the adapter
        tier=Tier.GPU,
        block_keys=(21,),
    )
    assert isinstance(s2, BlockStored)
    assert (s2.tier, s2.lora_name, s2.parent_block_hash) == (Tier.CPU, "sql", 21)
    assert r == BlockRemoved(block_hashes=(21,), tier=Tier.GPU)
    assert c == AllBlocksCleared()


def test_sglang_map_with_attn_dp_rank() -> None:
    b = decode_batch(msgpack.packb({"ts": 0, "events": [], "attn_dp_rank": 2}))
    assert b.dp_rank == 2


def test_hashes_ints_and_bytes() -> None:
    assert engine_hash(5) == 5
    assert engine_hash(-1) == 2**64 - 1  # signed 64-bit: two's complement
    assert engine_hash(2**70 + 9) == 9
    digest = bytes(range(32))
    # vLLM's own int conversion of a bytes hash: big-endian, low 64 bits.
    assert engine_hash(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert engine_hash(b"\x01\x02") == 0x0102
    b = decode_batch(msgpack.packb([0, [stored_map(block_hashes=[digest, 3])]]))
    ev = b.events[0]
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (int.from_bytes(digest[-8:], "big"), 3)


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, Tier.GPU),
        ("GPU", Tier.GPU),
        ("CPU", Tier.CPU),
        ("CPU_PINNED", Tier.CPU),
        ("STORAGE", Tier.DISK),
        ("DISK", Tier.DISK),
        ("EXTERNAL", Tier.DISK),
        ("SOMETHING_NEW", Tier.DISK),
    ],
)
def test_media(medium: str | None, tier: Tier) -> None:
    assert medium_tier(medium) is tier


def test_malformed_events_are_counted_and_skipped() -> None:
    payload = msgpack.packb(
        [
            0,
            [
                {"type": "Unknown"},
                ["BlockStored", "not-a-list"],
                stored_map(block_hashes=[1.5]),
                42,
                ["BlockRemoved", [1], 3],  # medium must be a string
                stored_map(),
            ],
        ]
    )
    b = decode_batch(payload)
    assert b.malformed_events == 5
    assert len(b.events) == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never valid msgpack
        msgpack.packb(5),
        msgpack.packb([1.0]),
        msgpack.packb(["x", []]),
        msgpack.packb([1.0, {"a": 1}]),
        msgpack.packb({"events": []}),
    ],
)
def test_malformed_frames_raise(payload: bytes) -> None:
    with pytest.raises(MalformedFrame):
        decode_batch(payload)


def test_sequence_frame() -> None:
    assert decode_seq((7).to_bytes(8, "big")) == 7
    assert decode_seq(b"\xff" * 8) == 2**64 - 1
    with pytest.raises(MalformedFrame):
        decode_seq(b"\x00\x01")


def test_vllm_033_fields_extra_keys_groups_and_media() -> None:
    """What vLLM 0.33 sends: untagged extra keys per block, the group, newer media."""
    payload = msgpack.packb(
        {
            "ts": 1.0,
            "events": [
                stored_map(
                    lora_name="ad",
                    extra_keys=[["ad", "tenant"], ["ad", ["img-1", -3], b"emb"]],
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=128,
                    session_id="s",
                    medium="CPU_TIER2",
                ),
                stored_map(medium="OBJ", lookahead_token_ids=[[9], [9]]),
                {"type": "BlockRemoved", "block_hashes": [11], "medium": "FS", "group_idx": 1},
            ],
        }
    )
    b = decode_batch(payload)
    assert b.malformed_events == 0
    first, second, removed = b.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.extras == (
        BlockExtras(salt="tenant"),
        BlockExtras(media=(("img-1", -3),), other=(msgpack.packb(b"emb"),)),
    )
    assert (first.group, first.group_kind, first.sliding_window) == (1, "sliding_window", 128)
    assert first.tier is Tier.CPU and first.lora_name == "ad"
    assert second.tier is Tier.DISK and second.lookahead and second.extras is None
    assert removed == BlockRemoved(block_hashes=(11,), tier=Tier.DISK, group=1)


def test_sglang_cache_salt_field_scopes_the_chain_it_starts() -> None:
    """SGLang sends ``cache_salt`` as a field of its own: it keys a chain from its
    first block (as vLLM's salt in extra_keys does); a continued chain carries it
    through its parent's key."""
    root = stored_map(cache_salt="tenant-a")
    child = stored_map(block_hashes=[13], token_ids=TOKENS[:4], parent_block_hash=12)
    child["cache_salt"] = "tenant-a"
    both = stored_map(cache_salt="x", extra_keys=[["y"], None])
    b = decode_batch(msgpack.packb({"ts": 1.0, "events": [root, child, both]}))
    first, second, third = b.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.extras == (BlockExtras(salt="tenant-a"), None)
    assert second.extras is None
    assert isinstance(third, BlockStored) and third.extras == (BlockExtras(salt="y"), None)


def test_extra_keys_that_do_not_fit_the_hashes_skip_only_their_event() -> None:
    payload = msgpack.packb({"ts": 1.0, "events": [stored_map(extra_keys=[None]), stored_map()]})
    b = decode_batch(payload)
    assert b.malformed_events == 1 and len(b.events) == 1
