"""The bridge's pieces that need no network: its buffer, its wire form, its config."""

from __future__ import annotations

import json

import pytest

from indexer.bridge import wire
from indexer.bridge.cli import build_parser, cli_overrides, config_from_args
from indexer.bridge.config import load_config
from indexer.convert import batch_from_pb
from indexer.kvevents.buffer import BufferLimits, FrameBuffer
from indexer.model import (
    AllBlocksCleared,
    BlockExtras,
    BlockRemoved,
    BlockStored,
    EventBatch,
    InstanceId,
    Tier,
)
from kvmesh.configfile import ConfigError
from kvmesh.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    NotFound,
    PermissionDenied,
    Unavailable,
)


def frames(seq: int, size: int = 10) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), b"x" * size]


# -- the buffer -----------------------------------------------------------------------


async def test_a_full_buffer_drops_the_newest_and_remembers_the_highest_sequence() -> None:
    buf = FrameBuffer(BufferLimits(max_batches=3, max_bytes=1 << 20))
    assert [buf.put(frames(s)) for s in range(6)] == [True, True, True, False, False, False]
    assert len(buf) == 3 and buf.counters.dropped == 3 and buf.counters.high_water == 3
    assert buf.take_drops() == (True, 5)
    assert buf.take_drops() == (False, None)
    # What is kept is the oldest run, in order; room made takes new messages again.
    assert (await buf.get())[1] == (0).to_bytes(8, "big")
    assert buf.put(frames(6))
    kept = []
    while (f := buf.get_nowait()) is not None:
        kept.append(int.from_bytes(f[1], "big"))
    assert kept == [1, 2, 6] and buf.bytes == 0


def test_the_byte_bound_drops_too_but_an_empty_buffer_takes_any_message() -> None:
    buf = FrameBuffer(BufferLimits(max_batches=100, max_bytes=100))
    assert buf.put(frames(0, size=500))  # alone, however large: the stream logic judges it
    assert not buf.put(frames(1, size=1))
    assert buf.counters.bytes_dropped == 2 + 8 + 1
    buf.get_nowait()
    assert buf.put(frames(2, size=40)) and buf.put(frames(3, size=40))
    assert not buf.put(frames(4, size=40))
    assert buf.take_drops() == (True, 4)


def test_a_dropped_message_without_a_sequence_is_counted_but_names_none() -> None:
    buf = FrameBuffer(BufferLimits(max_batches=1, max_bytes=1 << 20))
    buf.put(frames(0))
    assert not buf.put([b"kv", b"bad", b""])
    assert buf.take_drops() == (True, None)
    with pytest.raises(ValueError):
        BufferLimits(0, 1)


# -- the wire form --------------------------------------------------------------------

IID = InstanceId("engine-0", 2)


def test_a_batch_reads_back_as_the_indexer_reads_it() -> None:
    stored = BlockStored(
        block_hashes=(11, 12),
        parent_block_hash=10,
        token_ids=tuple(range(8)),
        block_size=4,
        lora_name="adapter",
        tier=Tier.CPU,
        extras=(BlockExtras(salt="tenant"), BlockExtras(media=(("img", -2),))),
        group=1,
        group_kind="sliding_window",
        sliding_window=128,
    )
    keyed = BlockStored(block_hashes=(21,), block_keys=(21,), block_size=4)
    batch = EventBatch(
        IID,
        7,
        (stored, keyed, BlockRemoved((11,), tier=None, group=1), AllBlocksCleared()),
        timestamp=12.5,
        incarnation="bridge-abc",
        counts_copies=True,
    )
    assert batch_from_pb(wire.batch_to_pb(batch)) == batch


def test_events_the_api_cannot_carry_are_left_out_and_counted() -> None:
    plain = BlockStored((1,), token_ids=(0, 1, 2, 3), block_size=4)
    ahead = BlockStored((2, 3), token_ids=tuple(range(8)), block_size=4, lookahead=True)
    opaque = BlockStored(
        (4,), token_ids=(0, 1, 2, 3), block_size=4, extras=(BlockExtras(other=(b"\x01",)),)
    )
    kept, left_out = wire.sendable((plain, ahead, BlockRemoved((1,)), opaque))
    assert kept == (plain, BlockRemoved((1,)))
    assert left_out == {"lookahead": 2, "opaque_extras": 1}
    events = (plain, AllBlocksCleared())
    assert wire.sendable(events) == (events, {})


def test_status_codes_map_to_what_the_stream_logic_acts_on() -> None:
    assert isinstance(wire.error_for(14, "down"), Unavailable)
    assert isinstance(wire.error_for(4, "slow"), Unavailable)
    assert isinstance(wire.error_for(8, "rate"), Unavailable)
    assert isinstance(wire.error_for(9, "gone", "instance"), FailedPrecondition)
    assert isinstance(wire.error_for(5, "gone"), NotFound)
    assert isinstance(wire.error_for(7, "no"), PermissionDenied)
    err = wire.error_for(3, "bad id", "events[2].stored.token_ids[7]")
    assert isinstance(err, InvalidArgument) and wire.event_index(err.field) == 2
    other = wire.error_for(13, "bug")
    assert type(other) is KvmeshError and "INTERNAL" in str(other)
    assert wire.event_index("instance") is None


# -- the config -----------------------------------------------------------------------

ENDPOINT = {"worker_id": "w0", "model": "m", "endpoint": "tcp://127.0.0.1:5557"}


def test_environment_gives_the_whole_config_as_a_sidecar_would() -> None:
    env = {
        "KVMESH_BRIDGE_INDEXER__TARGET": "dns:///kvmesh-indexer-headless.ns.svc:50051",
        "KVMESH_BRIDGE_INDEXER__TLS__CA_FILE": "/etc/ca.crt",
        "KVMESH_BRIDGE_ENGINE_EVENTS__ENDPOINTS": json.dumps([ENDPOINT]),
        "KVMESH_BRIDGE_BUFFER__MAX_BATCHES": "64",
        "KVMESH_BRIDGE_INCARNATION_PREFIX": "0f3c-uid",
    }
    cfg = load_config(environ=env)
    assert cfg.indexer.target.startswith("dns:///") and cfg.indexer.tls.active
    assert cfg.engine_events.endpoints[0].worker_id == "w0"
    assert cfg.buffer.max_batches == 64 and cfg.incarnation_prefix == "0f3c-uid"


def test_flags_override_the_environment() -> None:
    ns = build_parser().parse_args(
        [
            "--indexer",
            "10.0.0.5:50051,10.0.0.6:50051",
            "--zmq-endpoint",
            "worker_id=w1,model=m,endpoint=ipc:///run/e/pub,replay_endpoint=ipc:///run/e/rep",
            "--on-unrecoverable-gap",
            "stale",
        ]
    )
    env = {"KVMESH_BRIDGE_ENGINE_EVENTS__ENDPOINTS": json.dumps([ENDPOINT])}
    cfg = load_config(environ=env, cli=cli_overrides(ns))
    assert [ep.worker_id for ep in cfg.engine_events.endpoints] == ["w1"]
    assert cfg.engine_events.on_unrecoverable_gap == "stale"
    assert cfg.indexer.target == "10.0.0.5:50051,10.0.0.6:50051"
    only_flags = build_parser().parse_args(["--zmq-endpoint", "worker_id=a,model=m,endpoint=x"])
    assert config_from_args(only_flags).engine_events.endpoints[0].worker_id == "a"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "engine_events.endpoints: give the engine's stream"),
        (
            {"KVMESH_BRIDGE_ENGINE_EVENTS__ENDPOINTS": json.dumps([ENDPOINT, ENDPOINT])},
            "is listed twice",
        ),
        (
            {
                "KVMESH_BRIDGE_ENGINE_EVENTS__ENDPOINTS": json.dumps([ENDPOINT]),
                "KVMESH_BRIDGE_INDEXER__TARGET": "indexer-0:50051,indexer-1:50051",
            },
            "a list of replicas takes IP addresses",
        ),
        (
            {
                "KVMESH_BRIDGE_ENGINE_EVENTS__ENDPOINTS": json.dumps([ENDPOINT]),
                "KVMESH_BRIDGE_INCARNATION_PREFIX": "has space",
            },
            "incarnation_prefix",
        ),
        (
            {
                "KVMESH_BRIDGE_ENGINE_EVENTS__ENDPOINTS": json.dumps([ENDPOINT]),
                "KVMESH_BRIDGE_BUFER__MAX_BATCHES": "8",
            },
            "unknown key 'bufer'",
        ),
    ],
)
def test_bad_settings_are_refused_naming_them(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(environ=env)
