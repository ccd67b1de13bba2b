"""Helpers of the quota tests: mTLS servers of the test policy, callers, registering, publishing.

Kept to what the indexer had before quotas existed, so that the reproductions of
issue 20's findings (test_quota_findings.py) run against it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from indexer.server import IndexerServer, start_server
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.errors import ERROR_FIELD_METADATA
from tests.grpc.conftest import BLOCK, MODEL, ref, stored
from tests.security.pki import POLICY, Pki
from tests.security.test_indexer_security import Caller
from tests.security.test_indexer_security import config as tls_config

BACKENDS = ["memory", "redis"]


def policy_with(tmp_path: Path, **rules: dict[str, Any]) -> str:
    """The test policy with ``rules[name]`` merged into identity ``name``'s entry."""
    policy = copy.deepcopy(POLICY)
    for ident in policy["identities"]:
        ident.update(rules.get(ident["name"], {}))
    path = tmp_path / f"policy-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(policy))
    return str(path)


def backend_overrides(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Config overrides of backend ``request.param`` (a fresh key prefix on the
    session's Redis), for a ``backend`` fixture parametrized by :data:`BACKENDS`."""
    if request.param == "memory":
        return {}
    server = request.getfixturevalue("redis_server")
    return {"backend": "redis", "redis": {"url": server.url, "prefix": f"q{uuid.uuid4().hex[:8]}"}}


@contextlib.asynccontextmanager
async def serving(
    pki: Pki, *, policy: str | None = None, index: Any = None, **over: Any
) -> AsyncIterator[IndexerServer]:
    """An mTLS indexer with the test policy (or ``policy``) and config overrides."""
    if policy is not None:
        over["auth"] = {"policy_file": policy}
    s = await start_server(tls_config(pki, **over), index)
    try:
        yield s
    finally:
        await s.stop(0)


@contextlib.asynccontextmanager
async def callers(pki: Pki, server: IndexerServer, *names: str) -> AsyncIterator[list[Caller]]:
    made = [Caller(server.address, pki.client_tls(n)) for n in names]
    try:
        yield made
    finally:
        for c in made:
            await c.close()


def field_of(err: grpc.aio.AioRpcError) -> str:
    """The field a refusal names (the ``kvmesh-error-field`` trailer)."""
    for k, v in err.trailing_metadata() or ():
        if k == ERROR_FIELD_METADATA:
            return v if isinstance(v, str) else v.decode()
    return ""


async def try_register(
    stub: Any, worker: str, rank: int = 0, model: str = MODEL
) -> grpc.aio.AioRpcError | None:
    """Register ``worker``/``rank``; the error when refused, None when registered."""
    try:
        await stub.RegisterInstance(
            pb.RegisterInstanceRequest(instance=ref(worker, rank), model=model), timeout=10
        )
    except grpc.aio.AioRpcError as e:
        return e
    return None


async def register_all(stub: Any, specs: Sequence[tuple[str, int, str]]) -> list[Any]:
    """Register every ``(worker, rank, model)``, 32 at a time; each outcome in order."""
    gate = asyncio.Semaphore(32)

    async def one(spec: tuple[str, int, str]) -> Any:
        async with gate:
            return await try_register(stub, *spec)

    return await asyncio.gather(*(one(s) for s in specs))


def refusals_by_field(outcomes: Sequence[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in outcomes:
        if e is not None:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
            out[field_of(e)] = out.get(field_of(e), 0) + 1
    return out


def keyed(hashes: Sequence[int], keys: Sequence[int] | None = None, lora: str = "") -> pb.Event:
    """A BlockStored with precomputed block keys (the keys default to the hashes)."""
    return pb.Event(
        stored=pb.BlockStored(
            block_hashes=list(hashes),
            block_keys=list(hashes if keys is None else keys),
            lora_name=lora,
            tier=pb.TIER_GPU,
        )
    )


def chain(first: int, n: int) -> pb.Event:
    """``n`` chained token blocks (hashes ``first``...), each of BLOCK distinct tokens."""
    tokens = list(range(first * BLOCK, (first + n) * BLOCK))
    return stored(list(range(first, first + n)), tokens)


async def publish(stub: Any, b: pb.EventBatch) -> pb.BatchAck:
    resp = await stub.PublishEvents(pb.PublishEventsRequest(batch=b), timeout=60)
    return resp.ack


async def blocks_of(stub: Any, worker: str, rank: int = 0) -> int:
    listed = await stub.ListInstances(pb.ListInstancesRequest(), timeout=10)
    for i in listed.instances:
        if (i.instance.worker_id, i.instance.dp_rank) == (worker, rank):
            return int(i.blocks)
    raise AssertionError(f"{worker}/{rank} is not registered")
