"""Every RPC of a kvmesh server, fuzzed with raw bytes (see tests/security/fuzzing.py).

Each target is a real server on a free 127.0.0.1 port, started in-process on
its own event loop; every method of every service it registers is called
with undecodable bytes, adversarial values in otherwise valid requests,
oversized messages, mixed streams and Hypothesis' random bytes (a fixed,
derandomized budget). No answer may be UNKNOWN or INTERNAL, INVALID_ARGUMENT
must name a field, and after every call the server must still answer its
liveness calls and have logged no error.

Targets (:data:`TARGETS`): the indexer (IndexerService, SGLang's KVIndexer)
and the cache simulator (TeeService, CacheSimService), each with health and
reflection. The tee and xfer servers join the list once they register their
services through kvmesh.grpcsvc.add_guarded.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import msgpack  # type: ignore[import-untyped]
import pytest
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer.kvevents.decode import MalformedFrame, decode_batch
from indexer.memory import MemoryIndex
from indexer.model import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from indexer.server import IndexerServer, start_server
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2 as spb
from kvmesh.api.tee.v1 import tee_pb2 as tpb
from kvmesh.api.xfer.v1 import xfer_pb2 as xpb
from lab.bench.testsink import TestSink
from tee.cachesim.config import CacheSimConfig
from tee.cachesim.server import CacheSimServer
from tee.config import TeeConfig
from tee.server import TeeServer
from tests.grpc.conftest import make_config
from tests.security.fuzzing import (
    Case,
    LogWatch,
    Method,
    ServerThread,
    Target,
    call_raw,
    check_case,
    methods_of,
    mutations,
    oversized_case,
    run_cases,
    stream_cases,
    undecodable_cases,
    wire_messages,
)
from xfer.config import PoolSettings, XferConfig
from xfer.server import start_server as start_xfer

#: Small enough that oversized requests stay cheap, large enough for a Match of
#: limits.max_match_blocks blocks of 4 tokens (the config checks it).
MAX_MESSAGE_BYTES = 512 << 10

HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
INDEXER = pb.DESCRIPTOR.services_by_name["IndexerService"]
KV_INDEXER = spb.DESCRIPTOR.services_by_name["KVIndexer"]
MODEL = "fuzz/model"
CONFIG = make_config(limits={"max_message_bytes": MAX_MESSAGE_BYTES})
LIMITS = CONFIG.limits


def _indexer_seeds() -> dict[str, list[Message]]:
    ref = pb.InstanceRef(worker_id="w0")
    gone = pb.InstanceRef(worker_id="gone")  # registered, then removed
    batch = pb.EventBatch(
        instance=ref,
        sequence=1,
        timestamp=1.5,
        events=[
            pb.Event(
                stored=pb.BlockStored(
                    block_hashes=[11, 12],
                    parent_block_hash=10,
                    token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                    block_size=4,
                    tier=pb.TIER_GPU,
                )
            ),
            pb.Event(removed=pb.BlockRemoved(block_hashes=[12], tier=pb.TIER_CPU)),
            pb.Event(cleared=pb.AllBlocksCleared()),
        ],
    )
    action = spb.ExternalKvAction(type=spb.ACTION_REPORT, tier=spb.TIER_HBM, hashes=[5, -6])
    svc = f"/{INDEXER.full_name}"
    sg = f"/{KV_INDEXER.full_name}"
    return {
        f"{svc}/RegisterInstance": [
            pb.RegisterInstanceRequest(
                instance=ref, model=MODEL, address="http://w0:8000", lease_ttl_seconds=600
            ),
            pb.RegisterInstanceRequest(instance=gone, model=MODEL, address="http://gone:8000"),
        ],
        f"{svc}/Heartbeat": [pb.HeartbeatRequest(instance=ref)],
        f"{svc}/RemoveInstance": [pb.RemoveInstanceRequest(instance=gone)],
        f"{svc}/ListInstances": [pb.ListInstancesRequest(model=MODEL)],
        f"{svc}/PublishEvents": [pb.PublishEventsRequest(batch=batch)],
        f"{svc}/PublishEventsStream": [pb.PublishEventsStreamRequest(batch=batch)],
        f"{svc}/GetStats": [pb.GetStatsRequest()],
        f"{svc}/DumpIndex": [pb.DumpIndexRequest(model=MODEL, max_blocks=10)],
        f"{svc}/Ping": [pb.PingRequest()],
        f"{svc}/Match": [pb.MatchRequest(model=MODEL, token_ids=list(range(1, 13)), max_blocks=8)],
        f"{sg}/ConfigureExpectedWorkers": [
            spb.ConfigureExpectedWorkersRequest(
                workers=[spb.ExpectedWorker(worker_id="s0", worker_address="http://s0:30000")]
            )
        ],
        f"{sg}/ReplaceExternalKvSnapshot": [
            spb.ReplaceExternalKvSnapshotRequest(
                worker_id="s0",
                worker_address="http://s0:30000",
                worker_epoch="e1",
                applied_seq=3,
                hashes_by_tier=[spb.TierHashes(tier=spb.TIER_DRAM, hashes=[5, -6])],
            )
        ],
        f"{sg}/ApplyExternalKvBatch": [
            spb.ApplyExternalKvBatchRequest(
                worker_id="s0",
                seq=4,
                worker_address="http://s0:30000",
                worker_epoch="e1",
                actions=[
                    action,
                    spb.ExternalKvAction(type=spb.ACTION_REVOKE, tier=spb.TIER_HBM, hashes=[-6]),
                    spb.ExternalKvAction(type=spb.ACTION_CLEAR_ALL_AT_TIER, tier=spb.TIER_SSD),
                ],
            )
        ],
        f"{sg}/MatchExternalKv": [spb.MatchExternalKvRequest(hashes=[5, -6], count_as_hit=True)],
        f"{sg}/MatchExternalKvPrefix": [
            spb.MatchExternalKvPrefixRequest(hashes=[5, -6], max_blocks=2)
        ],
        f"{sg}/GetExternalKvHitCounts": [spb.GetExternalKvHitCountsRequest(hashes=[5])],
        f"/{HEALTH.full_name}/Check": [health_pb2.HealthCheckRequest(service=INDEXER.full_name)],
        f"/{HEALTH.full_name}/Watch": [health_pb2.HealthCheckRequest()],
        f"/{REFLECTION.full_name}/ServerReflectionInfo": [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=INDEXER.full_name),
        ],
    }


def _ack_errors(data: bytes) -> list[tuple[int, str]]:
    ack = pb.PublishEventsStreamResponse.FromString(data).ack
    if ack.outcome != pb.BATCH_OUTCOME_REJECTED:
        return []
    return [(ack.error.code, ack.error.field)]


INDEXER_SERVICES = [INDEXER, KV_INDEXER, HEALTH, REFLECTION]


@contextmanager
def _indexer_target() -> Iterator[Target]:
    """An indexer (memory backend, SGLang API on) on a free port."""
    thread: ServerThread[IndexerServer] = ServerThread(
        lambda: start_server(CONFIG, MemoryIndex()), lambda s: s.stop(0)
    )
    with thread as server:
        channel = grpc.insecure_channel(
            server.address, options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        with channel:
            yield Target(
                name="indexer",
                channel=channel,
                services=INDEXER_SERVICES,
                seeds=_indexer_seeds(),
                liveness=[
                    (f"/{INDEXER.full_name}/Ping", b""),
                    (f"/{HEALTH.full_name}/Check", b""),
                ],
                max_message_bytes=MAX_MESSAGE_BYTES,
                in_band={f"/{INDEXER.full_name}/PublishEventsStream": _ack_errors},
                logs=LOGS,
            )


TEE = tpb.DESCRIPTOR.services_by_name["TeeService"]
CACHESIM = tpb.DESCRIPTOR.services_by_name["CacheSimService"]
CACHESIM_SERVICES = [TEE, CACHESIM, HEALTH, REFLECTION]


def _routed(**kw: Any) -> tpb.RoutedEvent:
    base: dict[str, Any] = {
        "kind": tpb.EVENT_KIND_INGEST,
        "model": MODEL,
        "input_ids": [1, 2, 3, 4, 5, 6],
        "request_id": "r1",
        "worker": "w0",
        "prompt_len": 6,
    }
    base.update(kw)
    return tpb.RoutedEvent(**base)


def _cachesim_seeds() -> dict[str, list[Message]]:
    extend = _routed(kind=tpb.EVENT_KIND_EXTEND, input_ids=[7, 8], output_tokens=2)
    extend.ClearField("prompt_len")
    events = [_routed(), extend]
    return {
        f"/{TEE.full_name}/OfferEvents": [tpb.OfferEventsRequest(events=events)],
        f"/{TEE.full_name}/StreamEvents": [tpb.StreamEventsRequest(events=events)],
        f"/{TEE.full_name}/GetTeeStats": [tpb.GetTeeStatsRequest()],
        f"/{CACHESIM.full_name}/GetReport": [tpb.GetReportRequest(model=MODEL)],
        f"/{HEALTH.full_name}/Check": [health_pb2.HealthCheckRequest(service=TEE.full_name)],
        f"/{HEALTH.full_name}/Watch": [health_pb2.HealthCheckRequest()],
        f"/{REFLECTION.full_name}/ServerReflectionInfo": [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=TEE.full_name),
        ],
    }


@contextmanager
def _cachesim_target() -> Iterator[Target]:
    """A cache simulator (gRPC and HTTP) on free ports."""
    config = CacheSimConfig(
        http_port=0,
        grpc_port=0,
        block_size=2,
        worker_capacity_blocks=64,
        max_message_bytes=MAX_MESSAGE_BYTES,
    )
    thread: ServerThread[CacheSimServer] = ServerThread(
        CacheSimServer(config).start, lambda s: s.stop(0)
    )
    with thread as server, grpc.insecure_channel(server.grpc_address) as channel:
        yield Target(
            name="cachesim",
            channel=channel,
            services=CACHESIM_SERVICES,
            seeds=_cachesim_seeds(),
            liveness=[
                (f"/{HEALTH.full_name}/Check", b""),
                (f"/{CACHESIM.full_name}/GetReport", b""),
            ],
            max_message_bytes=MAX_MESSAGE_BYTES,
            logs=LOGS,
        )


TEE_SERVICES = [TEE, HEALTH, REFLECTION]


def _tee_seeds() -> dict[str, list[Message]]:
    seeds = _cachesim_seeds()
    del seeds[f"/{CACHESIM.full_name}/GetReport"]
    return seeds


@contextmanager
def _tee_target() -> Iterator[Target]:
    """A tee with one HTTP sink (a test sink on the same loop), on a free port."""

    async def start() -> tuple[TeeServer, TestSink]:
        sink = await TestSink(record=False).start()
        config = TeeConfig.model_validate(
            {
                "port": 0,
                "metrics_port": 0,
                "sinks": [{"type": "http", "url": sink.url}],
                "queue_size": 64,
                "shutdown_deadline_s": 2,
                "max_message_bytes": MAX_MESSAGE_BYTES,
            }
        )
        return await TeeServer(config).start(), sink

    async def stop(running: tuple[TeeServer, TestSink]) -> None:
        await running[0].stop(0)
        await running[1].stop()

    with (
        ServerThread(start, stop) as (server, _),
        grpc.insecure_channel(server.address) as channel,
    ):
        yield Target(
            name="tee",
            channel=channel,
            services=TEE_SERVICES,
            seeds=_tee_seeds(),
            liveness=[
                (f"/{HEALTH.full_name}/Check", b""),
                (f"/{TEE.full_name}/GetTeeStats", b""),
            ],
            max_message_bytes=MAX_MESSAGE_BYTES,
            logs=LOGS,
        )


XFER = xpb.DESCRIPTOR.services_by_name["XferService"]
XFER_SERVICES = [XFER, HEALTH, REFLECTION]
#: Below xfer's default (4 MiB): the fuzzed sidecar is configured with it.
XFER_MAX_MESSAGE_BYTES = 1 << 20
XFER_PAGE, XFER_PAGES, XFER_AUX, XFER_AUXN = 1024, 64, 32, 4


def _xfer_seeds(metadata: bytes) -> dict[str, list[Message]]:
    x = f"/{XFER.full_name}"
    return {
        f"{x}/Bootstrap": [
            xpb.BootstrapRequest(
                room=1,
                generation=1,
                dst_page_indices=[1, 2],
                aux_index=0,
                peer_name="peer-x",
                agent_metadata=metadata,
                peer_address="127.0.0.1:1",
                page_size=XFER_PAGE,
                page_count=XFER_PAGES,
                aux_size=XFER_AUX,
                aux_count=XFER_AUXN,
                transport="tcp",
            )
        ],
        f"{x}/Poll": [xpb.PollRequest(room=2)],
        f"{x}/Heartbeat": [xpb.HeartbeatRequest(peer_name="peer-x")],
        f"{x}/Abort": [xpb.AbortRequest(room=3, generation=1, reason="fuzz")],
        f"/{HEALTH.full_name}/Check": [health_pb2.HealthCheckRequest(service=XFER.full_name)],
        f"/{HEALTH.full_name}/Watch": [health_pb2.HealthCheckRequest()],
        f"/{REFLECTION.full_name}/ServerReflectionInfo": [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=XFER.full_name),
        ],
    }


@contextmanager
def _xfer_target() -> Iterator[Target]:
    """A prefill xfer sidecar (TCP transport, a pool in a temporary directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        pool = PoolSettings(
            path=str(Path(tmp) / "pool"),
            page_size=XFER_PAGE,
            page_count=XFER_PAGES,
            aux_size=XFER_AUX,
            aux_count=XFER_AUXN,
            create=True,
        )
        config = XferConfig.model_validate(
            {
                "role": "prefill",
                "port": 0,
                "metrics_port": 0,
                "transport": "tcp",
                "pool": pool,
                "limits": {"max_message_bytes": XFER_MAX_MESSAGE_BYTES},
            }
        )
        with (
            ServerThread(lambda: start_xfer(config), lambda s: s.stop(0)) as server,
            grpc.insecure_channel(server.address) as channel,
        ):
            yield Target(
                name="xfer",
                channel=channel,
                services=XFER_SERVICES,
                seeds=_xfer_seeds(server.transport.metadata()),
                liveness=[(f"/{HEALTH.full_name}/Check", b"")],
                max_message_bytes=XFER_MAX_MESSAGE_BYTES,
                logs=LOGS,
            )


#: Target name -> (how to start it, the services it registers): every server
#: that registers its services through kvmesh.grpcsvc.add_guarded.
TARGETS: dict[str, tuple[Callable[[], AbstractContextManager[Target]], list[ServiceDescriptor]]] = {
    "indexer": (_indexer_target, INDEXER_SERVICES),
    "cachesim": (_cachesim_target, CACHESIM_SERVICES),
    "tee": (_tee_target, TEE_SERVICES),
    "xfer": (_xfer_target, XFER_SERVICES),
}


#: Errors logged by any server of the process; drained after every case, so a
#: record is blamed on the case that caused it, whichever target logged it.
LOGS = LogWatch()


@pytest.fixture(scope="module")
def targets() -> Iterator[dict[str, Target]]:
    """Every target, started once for the module."""
    with LOGS.installed(), ExitStack() as stack:
        yield {name: stack.enter_context(start()) for name, (start, _) in TARGETS.items()}


def _params(streaming_only: bool = False) -> list[object]:
    out: list[object] = []
    for name, (_, services) in TARGETS.items():
        for m in methods_of(services):
            if streaming_only and not m.client_streaming:
                continue
            out.append(pytest.param(name, m, id=f"{name}-{m}"))
    return out


def _assert_clean(problems: list[str]) -> None:
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:40])


def test_the_fuzzed_services_are_all_the_server_serves(targets: dict[str, Target]) -> None:
    (reflect,) = methods_of([REFLECTION])
    for target in targets.values():
        req = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
        out = call_raw(target.channel, reflect, [req])
        assert out.code == grpc.StatusCode.OK, out
        listed = reflection_pb2.ServerReflectionResponse.FromString(out.responses[0])
        names = {s.name for s in listed.list_services_response.service}
        assert names == {s.full_name for s in target.services}


_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


def test_the_seeds_are_accepted(targets: dict[str, Target]) -> None:
    """The mutations start from valid requests, so that they reach the logic."""
    for target in targets.values():
        for method in target.methods():
            if method.path not in target.seeds:
                continue
            for frame in target.good_frames(method):
                out = call_raw(target.channel, method, [frame])
                # Valid requests: any answer but a refusal of the input (some
                # seeds name rooms or instances that do not exist).
                assert out.code not in _REFUSED, (method.path, out)
                parse = target.in_band.get(method.path)
                if parse is not None:
                    assert not [e for r in out.responses for e in parse(r)], (method.path, out)


@pytest.mark.parametrize(("name", "method"), _params())
def test_undecodable_bytes_are_invalid_argument(
    targets: dict[str, Target], name: str, method: Method
) -> None:
    cases = undecodable_cases(method)
    assert len(cases) >= 10
    _assert_clean(run_cases(targets[name], method, cases))


@pytest.mark.parametrize(("name", "method"), _params())
def test_adversarial_values_get_a_clear_status(
    targets: dict[str, Target], name: str, method: Method
) -> None:
    target = targets[name]
    cases = mutations(method, target.seeds_of(method)[0], target.max_message_bytes)
    cases += [Case(f"seed {i}", (s,)) for i, s in enumerate(target.good_frames(method))]
    cases.append(Case("empty request", (b"",)))
    _assert_clean(run_cases(target, method, cases))


def _first_methods() -> list[object]:
    # grpc enforces the size limit before it dispatches a call, so one method
    # per service shows it (every client-streaming method also gets an
    # oversized frame mid-stream below); a refused oversized call costs grpc
    # 0.1 to 1 s, too much to repeat for every method.
    out: list[object] = []
    for name, (_, services) in TARGETS.items():
        for service in services:
            m = methods_of([service])[0]
            out.append(pytest.param(name, m, id=f"{name}-{m}"))
    return out


@pytest.mark.parametrize(("name", "method"), _first_methods())
def test_oversized_requests_are_resource_exhausted(
    targets: dict[str, Target], name: str, method: Method
) -> None:
    target = targets[name]
    case = oversized_case(method, target.max_message_bytes)
    assert method.decodes(case.frames[0])
    _assert_clean(check_case(target, method, case))


@pytest.mark.parametrize(("name", "method"), _params(streaming_only=True))
def test_streams_mixing_good_and_bad_frames(
    targets: dict[str, Target], name: str, method: Method
) -> None:
    target = targets[name]
    good = target.good_frames(method)
    singles = undecodable_cases(method)
    changed = mutations(method, target.seeds_of(method)[0], target.max_message_bytes)
    # Every unknown enum number, a third of the other values (all of them ran alone above).
    singles += [c for i, c in enumerate(changed) if c.enum_path or i % 3 == 0]
    singles.append(oversized_case(method, target.max_message_bytes))
    _assert_clean(run_cases(target, method, stream_cases(method, good, singles)))


_FUZZ = settings(
    max_examples=15,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize(("name", "method"), _params())
@_FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes(targets: dict[str, Target], name: str, method: Method, data: bytes) -> None:
    target = targets[name]
    frames = (target.good_frames(method)[0], data) if method.client_streaming else (data,)
    _assert_clean(check_case(target, method, Case("random bytes", frames)))


@pytest.mark.parametrize(("name", "method"), _params())
@_FUZZ
@given(st.data())
def test_random_messages(
    targets: dict[str, Target], name: str, method: Method, data: st.DataObject
) -> None:
    target = targets[name]
    raw = data.draw(wire_messages(method.input))
    frames = (target.good_frames(method)[0], raw) if method.client_streaming else (raw,)
    _assert_clean(check_case(target, method, Case("random message", frames)))


@pytest.mark.parametrize(("name", "method"), _params(streaming_only=True))
@_FUZZ
@given(st.data())
def test_random_streams(
    targets: dict[str, Target], name: str, method: Method, data: st.DataObject
) -> None:
    target = targets[name]
    frame = st.one_of(
        st.sampled_from(target.good_frames(method)),
        st.binary(max_size=100),
        wire_messages(method.input),
    )
    frames = tuple(data.draw(st.lists(frame, min_size=1, max_size=6)))
    _assert_clean(check_case(target, method, Case("random stream", frames)))


# -- the indexer's field paths, exactly ---------------------------------------------


def _indexer_method(service: object, name: str) -> Method:
    (m,) = [m for m in methods_of([service]) if m.name == name]  # type: ignore[list-item]
    return m


@pytest.mark.parametrize(
    ("service", "method_name", "message", "field"),
    [
        (
            INDEXER,
            "PublishEvents",
            pb.PublishEventsRequest(
                batch=pb.EventBatch(
                    instance=pb.InstanceRef(worker_id="w0"),
                    events=[
                        pb.Event(cleared=pb.AllBlocksCleared()),
                        pb.Event(stored=pb.BlockStored(block_hashes=[1], tier=999)),  # type: ignore[arg-type]
                    ],
                )
            ),
            "events[1].stored.tier",
        ),
        (
            INDEXER,
            "PublishEvents",
            pb.PublishEventsRequest(
                batch=pb.EventBatch(
                    instance=pb.InstanceRef(worker_id="w0"),
                    events=[pb.Event(removed=pb.BlockRemoved(block_hashes=[1], tier=-1))],  # type: ignore[arg-type]
                )
            ),
            "events[0].removed.tier",
        ),
        (
            KV_INDEXER,
            "ApplyExternalKvBatch",
            spb.ApplyExternalKvBatchRequest(
                worker_id="s9",
                actions=[
                    spb.ExternalKvAction(type=spb.ACTION_REPORT, tier=spb.TIER_HBM, hashes=[1]),
                    spb.ExternalKvAction(type=999, tier=spb.TIER_HBM, hashes=[1]),  # type: ignore[arg-type]
                ],
            ),
            "actions[1].type",
        ),
        (
            KV_INDEXER,
            "ApplyExternalKvBatch",
            spb.ApplyExternalKvBatchRequest(
                worker_id="s9",
                actions=[spb.ExternalKvAction(type=spb.ACTION_REVOKE, tier=-7, hashes=[1])],  # type: ignore[arg-type]
            ),
            "actions[0].tier",
        ),
        (
            KV_INDEXER,
            "ReplaceExternalKvSnapshot",
            spb.ReplaceExternalKvSnapshotRequest(
                worker_id="s9",
                hashes_by_tier=[spb.TierHashes(tier=4, hashes=[1])],  # type: ignore[arg-type]
            ),
            "hashes_by_tier[0].tier",
        ),
        # Errors of the SGLang API name its own fields, not the kvmesh ones behind them.
        (
            KV_INDEXER,
            "ConfigureExpectedWorkers",
            spb.ConfigureExpectedWorkersRequest(
                workers=[
                    spb.ExpectedWorker(worker_id="fz-ok", worker_address="http://ok:1"),
                    spb.ExpectedWorker(worker_id="w" * 300),
                ]
            ),
            "workers[1].worker_id",
        ),
        (
            KV_INDEXER,
            "ConfigureExpectedWorkers",
            spb.ConfigureExpectedWorkersRequest(
                workers=[spb.ExpectedWorker(worker_id="fz-ok", worker_address="h" * 3000)]
            ),
            "workers[0].worker_address",
        ),
        (
            KV_INDEXER,
            "ApplyExternalKvBatch",
            spb.ApplyExternalKvBatchRequest(worker_id="s9", worker_epoch="e" * 300),
            "worker_epoch",
        ),
        (
            KV_INDEXER,
            "ApplyExternalKvBatch",
            spb.ApplyExternalKvBatchRequest(
                worker_id="s9",
                actions=[
                    spb.ExternalKvAction(type=spb.ACTION_REPORT, tier=spb.TIER_HBM, hashes=[i])
                    for i in range(LIMITS.max_events_per_batch + 1)
                ],
            ),
            "actions",
        ),
        (
            KV_INDEXER,
            "GetExternalKvHitCounts",
            # Capped like the matches: the answer grows with the request.
            spb.GetExternalKvHitCountsRequest(hashes=list(range(LIMITS.max_match_blocks + 1))),
            "hashes",
        ),
    ],
)
def test_errors_name_the_exact_field(
    targets: dict[str, Target], service: object, method_name: str, message: object, field: str
) -> None:
    method = _indexer_method(service, method_name)
    out = call_raw(targets["indexer"].channel, method, [message.SerializeToString()])  # type: ignore[attr-defined]
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT, out
    assert out.field == field
    assert out.details.startswith(f"{field}: ")


def test_unknown_tier_in_a_stream_is_a_rejected_ack_naming_the_field(
    targets: dict[str, Target],
) -> None:
    method = _indexer_method(INDEXER, "PublishEventsStream")
    bad = pb.PublishEventsStreamRequest(
        batch=pb.EventBatch(
            instance=pb.InstanceRef(worker_id="w0"),
            sequence=7,
            events=[pb.Event(stored=pb.BlockStored(block_hashes=[1], tier=12345))],  # type: ignore[arg-type]
        )
    )
    out = call_raw(targets["indexer"].channel, method, [bad.SerializeToString()])
    assert out.code == grpc.StatusCode.OK, out
    (resp,) = [pb.PublishEventsStreamResponse.FromString(r) for r in out.responses]
    assert resp.ack.outcome == pb.BATCH_OUTCOME_REJECTED
    assert resp.ack.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert resp.ack.error.field == "events[0].stored.tier"


# -- engine KV-event frames (the indexer's ZMQ input) -------------------------------

_MSGPACK_NAMES = st.sampled_from(
    ["type", "ts", "events", "block_hashes", "parent_block_hash", "token_ids", "block_size",
     "lora_id", "lora_name", "medium", "data_parallel_rank", "BlockStored", "BlockRemoved",
     "AllBlocksCleared", "GPU", "cpu_pinned"]
)  # fmt: skip
_MSGPACK_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=12),
    _MSGPACK_NAMES,
)
_MSGPACK = st.recursive(
    _MSGPACK_LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.lists(inner, max_size=7).map(lambda v: ["BlockStored", *v]),
        st.dictionaries(st.one_of(_MSGPACK_NAMES, st.integers(-5, 5)), inner, max_size=6),
    ),
    max_leaves=15,
)


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(st.one_of(_MSGPACK, st.tuples(st.floats(), st.lists(_MSGPACK), _MSGPACK).map(list)))
def test_engine_event_frames_decode_or_are_malformed(obj: object) -> None:
    payload = msgpack.packb(obj)
    try:
        batch = decode_batch(payload, engine_hash_keys=True)
    except MalformedFrame:
        return
    for ev in batch.events:
        assert isinstance(ev, BlockStored | BlockRemoved | AllBlocksCleared)
        if isinstance(ev, AllBlocksCleared):
            continue
        assert all(0 <= h < 1 << 64 for h in ev.block_hashes)
        assert ev.tier is None or isinstance(ev.tier, Tier)
        if isinstance(ev, BlockStored):
            assert isinstance(ev.block_size, int) and isinstance(ev.lora_name, str)
            assert ev.parent_block_hash is None or 0 <= ev.parent_block_hash < 1 << 64
