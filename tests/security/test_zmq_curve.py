"""CURVE on the engine-event subscriber: only the engine holding the key pair is heard.

The publisher here is a real ZMQ PUB socket acting as CURVE server (what an
engine build with CURVE enabled does); subscribers run inside a real indexer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from indexer.config import ZmqEndpointSettings
from indexer.memory import MemoryIndex
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from tests.grpc.conftest import MODEL, close_harness, make_config, open_harness
from tests.integration.test_zmq_subscriber import blocks, eventually, map_batch, stored


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def test_only_subscribers_with_the_engine_key_receive(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    server_public, server_secret = zmq.curve_keypair()
    other_public, _ = zmq.curve_keypair()
    _, client_secret = zmq.curve_keypair()
    key_file = tmp_path / "subscriber.key"
    key_file.write_bytes(client_secret)

    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.curve_server = True
    pub.curve_secretkey = server_secret
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()

    def ep(worker: str, **curve: Any) -> dict[str, Any]:
        return {
            "worker_id": worker,
            "model": MODEL,
            "endpoint": endpoint,
            "topic": "kv",
            **curve,
        }

    good = ep("good", curve_server_key=server_public.decode(), curve_secret_key_file=str(key_file))
    wrong = ep("wrong", curve_server_key=other_public.decode(), curve_secret_key_file=str(key_file))
    plain = ep("plain")
    h = await open_harness(
        make_config(engine_events={"endpoints": [good, wrong, plain]}), MemoryIndex()
    )
    try:
        subs = {s.instance.worker_id: s for s in h.server.subscribers.subscribers}
        t = blocks(2)
        seq = 0

        async def delivered() -> bool:
            nonlocal seq
            payload = map_batch(stored([1], t[:4]), stored([2], t[4:], parent=1))
            await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
            seq += 1
            return subs["good"].counters.batches_applied > 0

        await eventually(delivered, within=10.0)
        resp = await h.stub.Match(pb.MatchRequest(model=MODEL, token_ids=t))
        assert [m.instance.worker_id for m in resp.matches] == ["good"]
        # Keep publishing a little: the others never complete a handshake.
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), map_batch()])
            seq += 1
            await asyncio.sleep(0.05)
        assert subs["wrong"].counters.messages == 0
        assert subs["plain"].counters.messages == 0
    finally:
        await close_harness(h)
        pub.close(linger=0)


def test_curve_settings_are_checked() -> None:
    public, _ = zmq.curve_keypair()
    base = {"worker_id": "w", "model": "m", "endpoint": "tcp://127.0.0.1:1"}
    with pytest.raises(ValueError, match="go together"):
        ZmqEndpointSettings.model_validate({**base, "curve_server_key": public.decode()})
    with pytest.raises(ValueError, match="40-character"):
        ZmqEndpointSettings.model_validate(
            {**base, "curve_server_key": "short", "curve_secret_key_file": "/x"}
        )
    with pytest.raises(ValueError, match="bind: false"):
        ZmqEndpointSettings.model_validate(
            {
                **base,
                "bind": True,
                "curve_server_key": public.decode(),
                "curve_secret_key_file": "/x",
            }
        )
