"""Match over gRPC: validation with field names, caps, truncation, namespaces."""

from __future__ import annotations

from typing import Any

import grpc

from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.blockkeys import block_keys
from tests.grpc.conftest import (
    BLOCK,
    MODEL,
    Harness,
    batch,
    expect_status,
    match,
    publish,
    register,
    stored,
)

TOKENS = list(range(100, 100 + 3 * BLOCK))  # three full blocks


async def _seed(stub: Any) -> None:
    await register(stub, "w0")
    await publish(stub, batch(1, stored([11, 12, 13], TOKENS)))


async def test_match_finds_the_stored_prefix(stub: Any) -> None:
    await _seed(stub)
    resp = await match(stub, [*TOKENS, 1, 2])  # a trailing partial block is ignored
    assert resp.total_blocks == 3
    assert resp.block_size == BLOCK
    assert [(m.instance.worker_id, m.depth, m.gpu_blocks) for m in resp.matches] == [("w0", 3, 3)]
    assert resp.matches[0].address == "http://w0:8000"


def _packed(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


async def test_packed_token_ids_answer_as_token_ids_do(stub: Any) -> None:
    await _seed(stub)
    await register(stub, "w1")
    await publish(stub, batch(1, stored([21], TOKENS[:BLOCK]), worker="w1"))
    for prompt in ([*TOKENS, 1, 2], TOKENS[: 2 * BLOCK], [7, *TOKENS], TOKENS[: BLOCK - 1]):
        plain = await match(stub, prompt)
        packed = await stub.Match(pb.MatchRequest(model=MODEL, packed_token_ids=_packed(prompt)))
        assert packed == plain
    resp = await stub.Match(pb.MatchRequest(model=MODEL, packed_token_ids=_packed(TOKENS)))
    assert [(m.instance.worker_id, m.depth) for m in resp.matches] == [("w0", 3), ("w1", 1)]


async def test_packed_token_ids_of_a_broken_length_name_the_field(stub: Any) -> None:
    err = await expect_status(
        stub.Match(pb.MatchRequest(model=MODEL, packed_token_ids=_packed(TOKENS) + b"\x01")),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert ("kvmesh-error-field", "packed_token_ids") in tuple(err.trailing_metadata() or ())
    both = await expect_status(
        stub.Match(pb.MatchRequest(model=MODEL, token_ids=TOKENS, packed_token_ids=b"\0" * 4)),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "not both" in (both.details() or "")
    with_keys = await expect_status(
        stub.Match(pb.MatchRequest(model=MODEL, block_keys=[1], packed_token_ids=b"\0" * 4)),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "not both" in (with_keys.details() or "")


async def test_negative_token_id_names_field_and_index(stub: Any) -> None:
    err = await expect_status(match(stub, [1, 2, 3, -1, 5]), grpc.StatusCode.INVALID_ARGUMENT)
    assert "token_ids[3]" in (err.details() or "")
    assert ("kvmesh-error-field", "token_ids[3]") in tuple(err.trailing_metadata() or ())


async def test_token_id_at_2_pow_32_is_rejected(stub: Any) -> None:
    err = await expect_status(
        match(stub, [0, (1 << 32) - 1, 1 << 32, 7]), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert "token_ids[2]" in (err.details() or "")
    assert "2^32" in (err.details() or "")


async def test_bad_token_in_partial_last_block_is_still_rejected(stub: Any) -> None:
    err = await expect_status(match(stub, [*range(BLOCK), -5]), grpc.StatusCode.INVALID_ARGUMENT)
    assert f"token_ids[{BLOCK}]" in (err.details() or "")


async def test_empty_prompt_is_an_empty_result(stub: Any) -> None:
    await _seed(stub)
    resp = await match(stub, [])
    assert list(resp.matches) == [] and resp.total_blocks == 0
    short = await match(stub, TOKENS[: BLOCK - 1])  # shorter than one block
    assert list(short.matches) == [] and short.total_blocks == 0


async def test_prompt_beyond_block_cap_names_field(harness: Harness) -> None:
    cap = harness.server.config.limits.max_match_blocks
    tokens = [1] * ((cap + 1) * BLOCK)
    err = await expect_status(match(harness.stub, tokens), grpc.StatusCode.INVALID_ARGUMENT)
    assert (err.details() or "").startswith("token_ids:")
    assert str(cap) in (err.details() or "")
    keys_err = await expect_status(
        harness.stub.Match(pb.MatchRequest(model=MODEL, block_keys=[1] * (cap + 1))),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert (keys_err.details() or "").startswith("block_keys:")


async def test_max_blocks_above_cap_names_field(harness: Harness) -> None:
    cap = harness.server.config.limits.max_match_blocks
    err = await expect_status(
        match(harness.stub, TOKENS, max_blocks=cap + 1), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (err.details() or "").startswith("max_blocks:")


async def test_max_blocks_truncates_a_long_prompt(harness: Harness) -> None:
    await _seed(harness.stub)
    cap = harness.server.config.limits.max_match_blocks
    long = TOKENS + [5] * ((cap + 10) * BLOCK)  # beyond the cap, but truncated explicitly
    resp = await match(harness.stub, long, max_blocks=2)
    assert resp.total_blocks == 2
    assert [m.depth for m in resp.matches] == [2]


async def test_tokens_and_keys_together_are_rejected(stub: Any) -> None:
    err = await expect_status(
        stub.Match(pb.MatchRequest(model=MODEL, token_ids=TOKENS, block_keys=[1, 2])),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "block_keys" in (err.details() or "")


async def test_keys_match_like_tokens(stub: Any) -> None:
    await _seed(stub)
    keys = block_keys(TOKENS, BLOCK, MODEL)
    resp = await stub.Match(pb.MatchRequest(model=MODEL, block_keys=keys[:2]))
    assert resp.block_size == 0 and resp.total_blocks == 2
    assert [m.depth for m in resp.matches] == [2]


async def test_unknown_namespace_is_empty_not_an_error(stub: Any) -> None:
    await _seed(stub)
    assert list((await match(stub, TOKENS, model="no/such-model")).matches) == []
    assert list((await match(stub, TOKENS, lora_name="some-lora")).matches) == []


async def test_missing_model_names_field(stub: Any) -> None:
    err = await expect_status(match(stub, TOKENS, model=""), grpc.StatusCode.INVALID_ARGUMENT)
    assert (err.details() or "").startswith("model:")


async def test_per_model_block_size_override() -> None:
    from indexer.memory import MemoryIndex
    from tests.grpc.conftest import close_harness, make_config, open_harness

    h = await open_harness(make_config(model_block_sizes={"big/model": 8}), MemoryIndex())
    try:
        resp = await match(h.stub, list(range(20)), model="big/model")
        assert resp.block_size == 8 and resp.total_blocks == 2
        assert (await match(h.stub, list(range(20)))).block_size == BLOCK
        # A batch of a big/model instance must use its block size: an event
        # keyed with another one is left out and counted, the batch applies.
        await register(h.stub, "wb", model="big/model")
        ack = await publish(h.stub, batch(1, stored([1], list(range(4))), worker="wb"))
        assert (ack.blocks_stored, ack.blocks_skipped) == (0, 1)
        ack = await publish(
            h.stub, batch(2, stored([1], list(range(8)), block_size=8), worker="wb")
        )
        assert (ack.blocks_stored, ack.blocks_skipped) == (1, 0)
    finally:
        await close_harness(h)


async def test_max_instances_keeps_the_deepest(stub: Any) -> None:
    for i, depth in enumerate([1, 3, 2, 3]):
        await register(stub, f"w{i}")
        await publish(
            stub, batch(1, stored([11, 12, 13][:depth], TOKENS[: depth * BLOCK]), worker=f"w{i}")
        )
    every = await match(stub, TOKENS)
    assert [(m.instance.worker_id, m.depth) for m in every.matches] == [
        ("w1", 3),
        ("w3", 3),
        ("w2", 2),
        ("w0", 1),
    ]
    top = await match(stub, TOKENS, max_instances=2)
    assert [(m.instance.worker_id, m.depth) for m in top.matches] == [("w1", 3), ("w3", 3)]
    assert top.total_blocks == 3
    assert len((await match(stub, TOKENS, max_instances=10)).matches) == 4
