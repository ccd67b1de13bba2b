"""Issue 20's lesser findings (item 6) on the indexer, with mutual TLS and the
test policy (tests/security/pki.py), on each backend.

- An expired and reaped instance's heartbeat, from the engine that owns it:
  NOT_FOUND (register again), not PERMISSION_DENIED naming model ''. (Expired
  but not yet reaped, a heartbeat renews it: docs/api.md, ``Heartbeat``.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from tests.grpc.conftest import MODEL, ref
from tests.security.pki import Pki
from tests.security.quota_calls import BACKENDS, backend_overrides, callers, serving


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    return backend_overrides(request)


async def test_an_expired_instance_heartbeat_is_not_found(
    pki: Pki, backend: dict[str, Any]
) -> None:
    async with (
        serving(pki, reap_interval_s=0.1, **backend) as server,
        callers(pki, server, "engine-a", "engine-b") as (owner, other),
    ):
        await owner.stub.RegisterInstance(
            pb.RegisterInstanceRequest(
                instance=ref("engine-a0"), model=MODEL, lease_ttl_seconds=0.3
            ),
            timeout=10,
        )
        await asyncio.sleep(1.0)  # expired, then reaped
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await owner.stub.Heartbeat(pb.HeartbeatRequest(instance=ref("engine-a0")), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
        assert "model ''" not in (e.value.details() or "")
        # and another engine still may not touch it
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await other.stub.Heartbeat(pb.HeartbeatRequest(instance=ref("engine-a0")), timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # registering again works, and so does the heartbeat after it
        await owner.stub.RegisterInstance(
            pb.RegisterInstanceRequest(instance=ref("engine-a0"), model=MODEL), timeout=10
        )
        await owner.stub.Heartbeat(pb.HeartbeatRequest(instance=ref("engine-a0")), timeout=10)
