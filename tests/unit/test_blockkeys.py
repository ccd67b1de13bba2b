"""Block keys against the spec's vectors and a second, plain implementation.

Version 2 added extra keys (docs/spec/block-keys.md, "Extra keys"): the
properties below pin what they may and may not change.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.blockkeys import (
    BLOCK_KEY_VERSION,
    TokenIdError,
    block_keys,
    chain_keys,
    encode_extras,
    namespace_seed,
    prompt_extras,
    to_signed,
    to_unsigned,
)

VECTORS = Path(__file__).resolve().parents[2] / "docs" / "spec" / "block-key-vectors.json"


Media = tuple[str, int, int]


def plain_extras(salt: str, media: list[Media], start: int, end: int) -> bytes:
    """``E_i`` of the block ``[start, end)`` as the spec words it (salt given for block 0 only)."""
    out = b""
    if salt:
        out += struct.pack("<BI", 1, len(salt.encode())) + salt.encode()
    for ident, off, length in media:
        if off < end and start < off + length:
            data = ident.encode() + struct.pack("<q", off - start)
            out += struct.pack("<BI", 2, len(data)) + data
    return out


def plain_keys(
    model: str,
    lora: str,
    tokens: list[int],
    bs: int,
    salt: str = "",
    media: list[Media] | None = None,
) -> list[int]:
    """The spec's formulas, one block at a time with struct."""
    parent = xxhash.xxh3_64_intdigest(model.encode() + b"\x00" + lora.encode())
    out = []
    for b in range(len(tokens) // bs):
        payload = struct.pack("<Q", parent) + struct.pack(f"<{bs}I", *tokens[b * bs : (b + 1) * bs])
        payload += plain_extras(salt if b == 0 else "", media or [], b * bs, (b + 1) * bs)
        parent = xxhash.xxh3_64_intdigest(payload)
        out.append(parent)
    return out


def load_vectors() -> list[dict[str, Any]]:
    doc = json.loads(VECTORS.read_text())
    assert doc["version"] == BLOCK_KEY_VERSION == 2
    vectors: list[dict[str, Any]] = doc["vectors"]
    return vectors


def vector_media(vec: dict[str, Any]) -> list[Media]:
    return [(str(ident), int(off), int(length)) for ident, off, length in vec["media"]]


@pytest.mark.parametrize("vec", load_vectors(), ids=lambda v: str(v["name"]))
def test_vectors(vec: dict[str, Any]) -> None:
    model, lora, bs = str(vec["model"]), str(vec["lora_name"]), int(vec["block_size"])
    tokens = [int(t) for t in vec["token_ids"]]
    salt, media = str(vec["cache_salt"]), vector_media(vec)
    assert str(namespace_seed(model, lora)) == vec["namespace_seed"]
    keys = block_keys(tokens, bs, model, lora, cache_salt=salt, media=media)
    assert [str(k) for k in keys] == vec["block_keys"]
    assert keys == plain_keys(model, lora, tokens, bs, salt, media)


def test_vectors_cover_the_edge_cases() -> None:
    vecs = load_vectors()
    assert all(isinstance(v["cache_salt"], str) and isinstance(v["media"], list) for v in vecs)
    assert any(not v["block_keys"] and v["token_ids"] for v in vecs)  # lone partial block
    assert any(v["lora_name"] for v in vecs)
    assert any(4294967295 in v["token_ids"] for v in vecs)
    assert any(v["cache_salt"] and v["media"] for v in vecs)
    assert len({v["cache_salt"] for v in vecs}) >= 3  # none and two salts
    assert any(not s.isascii() for s in (v["cache_salt"] for v in vecs))
    bs_media = [(int(v["block_size"]), vector_media(v)) for v in vecs]
    # An item over several blocks, and one that began before a block it overlaps.
    assert any(length > bs for bs, media in bs_media for _, _, length in media)
    assert any(
        off % bs and off // bs < (off + length - 1) // bs
        for bs, m in bs_media
        for _, off, length in m
    )
    # Two items in one prompt with identical placeholders and different identifiers.
    assert any(len({i for i, _, _ in m}) == len(m) > 1 for _, m in bs_media)


def test_extras_byte_layout() -> None:
    """tag || LE32(len(data)) || data; an item's offset is LE64 two's complement."""
    salt = b"\x01" + b"\x02\x00\x00\x00" + b"\xc3\xa9"
    image = b"\x02" + b"\x0b\x00\x00\x00" + b"img" + b"\xfd" + b"\xff" * 7
    other = b"\x03" + b"\x02\x00\x00\x00" + b"pe"
    assert encode_extras() == b""
    assert encode_extras("\u00e9", [("img", -3)], [b"pe"]) == salt + image + other
    assert encode_extras(media=[("img", 5)]).endswith(b"img\x05" + b"\x00" * 7)
    # Items keep the order they are given in: it is part of the key.
    two = encode_extras(media=[("b", 0), ("a", 0)])
    assert two != encode_extras(media=[("a", 0), ("b", 0)])


def test_prompt_extras_scope_the_salt_and_the_items() -> None:
    # Blocks of 4: the item's tokens are 2..9, so blocks 0, 1 and 2; block 3 has none.
    e = prompt_extras(4, 4, "s", [("x", 2, 8)])
    assert e == [
        encode_extras("s", [("x", 2)]),
        encode_extras("", [("x", -2)]),
        encode_extras("", [("x", -6)]),
        b"",
    ]
    assert prompt_extras(3, 4) is None
    # The item ends where block 1 starts, and one starts where block 1 ends: neither is in it.
    assert prompt_extras(3, 4, media=[("a", 0, 4), ("b", 8, 1)]) == [
        encode_extras(media=[("a", 0)]),
        b"",
        encode_extras(media=[("b", 0)]),
    ]


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=64),
    bs=st.integers(1, 9),
    model=st.text(max_size=12),
    lora=st.text(max_size=5),
)
def test_matches_plain_implementation(tokens: list[int], bs: int, model: str, lora: str) -> None:
    assert block_keys(tokens, bs, model, lora) == plain_keys(model, lora, tokens, bs)


media_items = st.lists(
    st.tuples(st.text(max_size=6), st.integers(0, 60), st.integers(1, 20)), max_size=3
)


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=64),
    bs=st.integers(1, 9),
    salt=st.text(max_size=6),
    media=media_items,
)
def test_extras_match_plain_implementation(
    tokens: list[int], bs: int, salt: str, media: list[Media]
) -> None:
    got = block_keys(tokens, bs, "m", "l", cache_salt=salt, media=media)
    assert got == plain_keys("m", "l", tokens, bs, salt, media)


@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=64), bs=st.integers(1, 9))
def test_a_plain_prompt_keeps_its_version_1_keys(tokens: list[int], bs: int) -> None:
    v1 = chain_keys(namespace_seed("m", "l"), tokens, bs)
    assert prompt_extras(len(tokens) // bs, bs) is None
    assert block_keys(tokens, bs, "m", "l") == v1
    assert block_keys(tokens, bs, "m", "l", cache_salt="", media=()) == v1
    # An item only in the partial last block touches no key either.
    tail = [("img", len(tokens) // bs * bs, bs)]
    assert block_keys(tokens, bs, "m", "l", media=tail) == v1


@given(
    tokens=st.lists(st.integers(0, 50), min_size=1, max_size=40),
    bs=st.integers(1, 8),
    salts=st.lists(st.text(max_size=6), min_size=2, max_size=2, unique=True),
)
def test_two_salts_share_no_key(tokens: list[int], bs: int, salts: list[str]) -> None:
    a = block_keys(tokens, bs, "m", cache_salt=salts[0])
    b = block_keys(tokens, bs, "m", cache_salt=salts[1])
    assert len(a) == len(tokens) // bs
    assert not set(a) & set(b)


@given(
    prefix=st.lists(st.integers(0, 3), max_size=24),
    a=st.lists(st.integers(0, 3), max_size=12),
    b=st.lists(st.integers(0, 3), max_size=12),
    bs=st.integers(1, 6),
    salt=st.text(min_size=1, max_size=6),
)
def test_one_salt_shares_exactly_the_common_prefix(
    prefix: list[int], a: list[int], b: list[int], bs: int, salt: str
) -> None:
    ta, tb = prefix + a, prefix + b
    common = 0
    while common < min(len(ta), len(tb)) and ta[common] == tb[common]:
        common += 1
    ka = block_keys(ta, bs, "m", cache_salt=salt)
    kb = block_keys(tb, bs, "m", cache_salt=salt)
    shared = common // bs
    assert ka[:shared] == kb[:shared]
    assert set(ka) & set(kb) == set(ka[:shared])


@given(
    tokens=st.lists(st.integers(0, 50), min_size=1, max_size=48),
    bs=st.integers(1, 8),
    offset=st.integers(0, 47),
    length=st.integers(1, 20),
    salt=st.text(max_size=3),
)
def test_moving_an_item_changes_its_blocks_and_every_later_key(
    tokens: list[int], bs: int, offset: int, length: int, salt: str
) -> None:
    before = block_keys(tokens, bs, "m", cache_salt=salt, media=[("img", offset, length)])
    after = block_keys(tokens, bs, "m", cache_salt=salt, media=[("img", offset + 1, length)])
    first = offset // bs  # the first block either placement overlaps
    assert before[:first] == after[:first]
    assert all(x != y for x, y in zip(before[first:], after[first:], strict=True))


@given(
    tokens=st.lists(st.integers(0, 50), min_size=8, max_size=40),
    cut=st.integers(1, 4),
    media=media_items,
)
def test_chaining_with_extras_after_a_parent(
    tokens: list[int], cut: int, media: list[Media]
) -> None:
    bs = 4
    whole = block_keys(tokens, bs, "m", cache_salt="s", media=media)
    if len(whole) <= cut:
        return
    extras = prompt_extras(len(tokens) // bs, bs, "s", media)
    assert extras is not None
    tail = chain_keys(whole[cut - 1], tokens[cut * bs :], bs, extras[cut:])
    assert whole[:cut] + tail == whole


@given(tokens=st.lists(st.integers(0, 50), min_size=8, max_size=40), cut=st.integers(1, 4))
def test_chaining_after_a_parent_equals_keying_the_whole_prompt(
    tokens: list[int], cut: int
) -> None:
    bs = 4
    whole = block_keys(tokens, bs, "m")
    head = block_keys(tokens[: cut * bs], bs, "m")
    if len(head) < cut:
        return
    tail = chain_keys(head[-1], tokens[cut * bs :], bs)
    assert head + tail == whole


def test_prefix_sharing_and_namespaces() -> None:
    a = block_keys([1, 2, 3, 4, 5, 6], 2, "m")
    b = block_keys([1, 2, 3, 4, 9, 9], 2, "m")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert block_keys([1, 2], 2, "m", "lora") != block_keys([1, 2], 2, "m")
    assert block_keys([1, 2], 2, "m2") != block_keys([1, 2], 2, "m")


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_out_of_range_token_ids_name_their_index(bad: int) -> None:
    with pytest.raises(TokenIdError) as err:
        block_keys([5, 6, bad, 7], 2, "m")
    assert err.value.index == 2 and err.value.value == bad


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        chain_keys(0, [1, 2], 0)


@given(st.integers(0, 2**64 - 1))
def test_signed_round_trip(key: int) -> None:
    s = to_signed(key)
    assert -(2**63) <= s < 2**63
    assert to_unsigned(s) == key
    assert struct.pack("<q", s) == struct.pack("<Q", key)
