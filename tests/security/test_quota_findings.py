"""Issue 20's findings 1 and 2 as an engine would make them, on a default install.

Mutual TLS and the test policy (tests/security/pki.py), defaults everywhere
else, the memory backend and a real redis-server. Each test names what the
attacker must not get and checks that the others are unaffected. Before the
per-identity quotas existed every one of them failed: the attacker got all
it asked for (see SECURITY.md, "Quotas").

- Finding 1: the engine owning ``engine-a*`` registers instance after
  instance (dp ranks, made-up models) until the fleet-wide caps lock every
  other engine, and the operator, out.
- Finding 2: it publishes blocks for its own instance until the replica runs
  out of memory.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from tests.grpc.conftest import MODEL, batch
from tests.security.pki import Pki
from tests.security.quota_calls import (
    BACKENDS,
    backend_overrides,
    blocks_of,
    callers,
    chain,
    field_of,
    keyed,
    publish,
    refusals_by_field,
    register_all,
    serving,
    try_register,
)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Config overrides of each backend."""
    return backend_overrides(request)


# -- finding 1: one engine denies registration to every other ----------------------------


async def test_finding_1_one_engine_cannot_take_every_instance(
    pki: Pki, backend: dict[str, Any]
) -> None:
    """Default install: the engine that owns ``engine-a*`` registers dp rank after
    dp rank; it is stopped at its own quota, the fleet's caps are never reached."""
    async with (
        serving(pki, **backend) as s,
        callers(pki, s, "engine-a", "engine-b", "admin") as (eng_a, eng_b, admin),
    ):
        quota = 256  # quotas.max_instances_per_identity
        outcomes = await register_all(eng_a.stub, [("engine-a", r, MODEL) for r in range(300)])
        assert outcomes.count(None) == quota
        assert refusals_by_field(outcomes) == {"quotas.max_instances_per_identity": 300 - quota}
        # The attacker's re-registrations still work (they add nothing) ...
        assert await try_register(eng_a.stub, "engine-a", 0) is None
        # ... and every other engine, and the operator, still registers.
        assert await try_register(eng_b.stub, "engine-b", 0) is None
        assert await try_register(admin.stub, "ops-0", 0) is None
        listed = await admin.stub.ListInstances(pb.ListInstancesRequest(), timeout=10)
        workers = [i.instance.worker_id for i in listed.instances]
        assert workers.count("engine-a") == quota
        assert "engine-b" in workers and "ops-0" in workers
        assert s.config.quotas.max_instances_per_identity == quota
        assert quota < s.config.limits.max_instances_per_namespace


async def test_finding_1_made_up_models_stop_at_the_namespace_quota(
    pki: Pki, backend: dict[str, Any]
) -> None:
    async with (
        serving(pki, **backend) as s,
        callers(pki, s, "engine-a", "engine-b", "admin") as (eng_a, eng_b, admin),
    ):
        quota = 64  # quotas.max_namespaces_per_identity
        outcomes = await register_all(
            eng_a.stub, [(f"engine-a-{i}", 0, f"made-up-{i}") for i in range(80)]
        )
        assert outcomes.count(None) == quota
        assert refusals_by_field(outcomes) == {"quotas.max_namespaces_per_identity": 80 - quota}
        # More instances of a model it already serves are no new namespace.
        held = next(i for i, e in enumerate(outcomes) if e is None)
        assert await try_register(eng_a.stub, "engine-a-x", 0, f"made-up-{held}") is None
        # Moving an instance to a new model while another serves its model would
        # be one more namespace.
        err = await try_register(eng_a.stub, f"engine-a-{held}", 0, "made-up-new")
        assert err is not None and field_of(err) == "quotas.max_namespaces_per_identity"
        # The others are not affected.
        assert await try_register(eng_b.stub, "engine-b", 0, "made-up-200") is None
        assert await try_register(admin.stub, "ops-0", 0, "made-up-201") is None
        assert (await s.index.quota_usage("engine-a")).namespaces == quota
        assert s.config.quotas.max_namespaces_per_identity == quota
        assert quota < s.config.limits.max_namespaces


# -- finding 2: one engine runs a replica out of memory ------------------------------------


async def publish_paced(stub: Any, b: pb.EventBatch) -> pb.BatchAck:
    """Publish ``b``, waiting and sending it again while the publish rate refuses it."""
    while True:
        try:
            return await publish(stub, b)
        except grpc.aio.AioRpcError as e:
            if field_of(e) != "quotas.publish_blocks_per_s":
                raise
            await asyncio.sleep(0.1)


async def test_finding_2_at_the_defaults_an_instance_holds_at_most_its_quota(pki: Pki) -> None:
    """Default install, memory backend: an engine publishing 1.1 M blocks for its own
    instance (finding 2 published 6.55 M) leaves it at max_blocks_per_instance."""
    async with serving(pki) as s, callers(pki, s, "engine-a", "engine-b") as (eng_a, eng_b):
        cap = 1 << 20  # quotas.max_blocks_per_instance
        assert await try_register(eng_a.stub, "engine-a") is None
        assert await try_register(eng_b.stub, "engine-b") is None
        per_event, events = 16_384, 4
        total = 0
        skipped = 0
        for seq in range(17):
            base = 1 + seq * per_event * events
            evs = [
                keyed(range(base + j * per_event, base + (j + 1) * per_event))
                for j in range(events)
            ]
            ack = await publish_paced(eng_a.stub, batch(seq, *evs, worker="engine-a"))
            assert ack.outcome == pb.BATCH_OUTCOME_APPLIED
            total += per_event * events
            skipped += ack.blocks_skipped
        assert total == 1_114_112
        assert await blocks_of(eng_a.stub, "engine-a") == cap
        assert skipped == total - cap
        ack = await publish(eng_b.stub, batch(0, chain(1, 8), worker="engine-b"))
        assert (ack.blocks_stored, ack.blocks_skipped) == (8, 0)
        assert s.logic.counters.events_skipped == {"quota": skipped}
        assert s.config.quotas.max_blocks_per_instance == cap
