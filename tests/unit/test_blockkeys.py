"""Block keys against the spec's vectors and a second, plain implementation."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.blockkeys import (
    TokenIdError,
    block_keys,
    chain_keys,
    namespace_seed,
    to_signed,
    to_unsigned,
)

VECTORS = Path(__file__).resolve().parents[2] / "docs" / "spec" / "block-key-vectors.json"


def plain_keys(model: str, lora: str, tokens: list[int], bs: int) -> list[int]:
    """The spec's formulas, one block at a time with struct."""
    parent = xxhash.xxh3_64_intdigest(model.encode() + b"\x00" + lora.encode())
    out = []
    for b in range(len(tokens) // bs):
        payload = struct.pack("<Q", parent) + struct.pack(f"<{bs}I", *tokens[b * bs : (b + 1) * bs])
        parent = xxhash.xxh3_64_intdigest(payload)
        out.append(parent)
    return out


def load_vectors() -> list[dict[str, object]]:
    doc = json.loads(VECTORS.read_text())
    assert doc["version"] == 1
    vectors: list[dict[str, object]] = doc["vectors"]
    return vectors


@pytest.mark.parametrize("vec", load_vectors(), ids=lambda v: str(v["name"]))
def test_vectors(vec: dict[str, object]) -> None:
    model, lora, bs = str(vec["model"]), str(vec["lora_name"]), int(str(vec["block_size"]))
    tokens = [int(t) for t in vec["token_ids"]]  # type: ignore[attr-defined]
    assert str(namespace_seed(model, lora)) == vec["namespace_seed"]
    assert [str(k) for k in block_keys(tokens, bs, model, lora)] == vec["block_keys"]


def test_vectors_cover_the_edge_cases() -> None:
    vecs = load_vectors()
    assert any(not v["block_keys"] and v["token_ids"] for v in vecs)  # lone partial block
    assert any(v["lora_name"] for v in vecs)
    assert any(4294967295 in v["token_ids"] for v in vecs)  # type: ignore[operator]


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=64),
    bs=st.integers(1, 9),
    model=st.text(max_size=12),
    lora=st.text(max_size=5),
)
def test_matches_plain_implementation(tokens: list[int], bs: int, model: str, lora: str) -> None:
    assert block_keys(tokens, bs, model, lora) == plain_keys(model, lora, tokens, bs)


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
