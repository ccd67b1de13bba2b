"""Engine-side bridges (``kvmesh bridge``) feeding indexer replicas, on real processes.

The engines are real vLLM 0.33 ``ZmqEventPublisher``\\ s
(``lab/engines/vllm_event_streams.py`` in ``.venv-vllm``) streaming events
derived from the Mooncake trace: each engine stores the blocks its requests
bring and evicts least recently used leaves past a capacity, one clears its
cache mid-stream. What an engine holds at the end (its stores minus its
removals since its last clear) is the truth the index must equal.

- :func:`test_bridges_keep_the_index_exact_through_a_stall_and_a_replica_kill`:
  four ``kvmesh bridge`` processes, one per engine, with small buffers, and
  two indexer replica processes over one redis-server. Mid-stream both
  replicas are stopped (SIGSTOP) for a while, so that the bridges' buffers
  overflow and drop, then one replica is SIGKILLed. Bridges 0 and 1 dial the
  replicas in order with ``pick_first`` (their streams are on the one killed),
  bridges 2 and 3 with ``round_robin`` over both. Afterwards every engine's
  truth equals what the surviving replica answers, block for block
  (DumpIndex) and by Match; the figures (published, applied, dropped,
  replayed, resent) are printed.
- :func:`test_a_full_buffer_drops_and_the_bridge_recovers`: an in-process
  indexer whose applies wait on a gate and a bridge with a 4-batch buffer:
  a burst while the gate is shut fills the buffer, the rest is dropped and
  counted; once the gate opens the bridge fetches the drops from the
  engine's replay socket and the index holds every block. With an engine
  whose replay buffer is too short to return them, the loss is not silent:
  the instance is reset (``on_unrecoverable_gap: reset``) and holds only
  blocks the engine holds.

Without the vLLM interpreter (``make setup``, or ``$KVMESH_VLLM_PYTHON``)
these tests fail, saying how to get it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from indexer.bridge.config import BridgeConfig
from indexer.bridge.service import Bridge, start_bridge
from indexer.model import InstanceId
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.blockkeys import chain_keys, namespace_seed
from lab.bench.soak import CHANNEL_OPTIONS, ReplicaProcess, wait_serving
from lab.children import ChildProcess, python_module, stop_all
from lab.conformance import vllm_python
from lab.engines.vllm_publishers import TRACE_BLOCK_TOKENS, endpoints, trace_tokens
from lab.redisproc import RedisProcess, free_port
from lab.traces import TraceRequest, load_mooncake
from lab.workload import TRACE_MODEL, instance_of
from tests.grpc.conftest import close_harness, make_config, open_harness
from tests.integration.test_zmq_recovery import GatedIndex

ROOT = Path(__file__).resolve().parents[2]

#: The replicas of lab/bench/soak.py key TRACE_MODEL at the trace's 512-token
#: blocks; the engines use the same block size.
MODEL = TRACE_MODEL
BLOCK = TRACE_BLOCK_TOKENS

ENGINES = 4
#: Trace requests spread over the engines: about 12,000 blocks stored in all,
#: a few thousand evicted.
REQUESTS = 600
#: Trace blocks an engine holds before it evicts (least recently used leaves).
CAPACITY = 160
#: Requests per batch (an engine step announcing a few requests).
PER_BATCH = 2
#: One batch per engine every this many seconds: the stream lasts a few seconds.
INTERVAL_S = 0.06
#: Engine batches a bridge buffers: small, so that the stall overflows it.
BUFFER = 4
#: How long both replicas are stopped mid-stream.
STALL_S = 1.5


# -- the engines' streams and their truth ------------------------------------------


@dataclass(slots=True)
class FleetPlan:
    """Per engine, its batches of plan events, and what it holds at the end."""

    streams: list[list[list[list[Any]]]]
    held: list[set[int]]
    parent: dict[int, int | None]
    stored: int = 0
    removed: int = 0
    clears: int = 0

    def plan(self, buffer_steps: int = 10_000, interval_s: float = INTERVAL_S) -> dict[str, Any]:
        """The plan file of lab/engines/vllm_event_streams.py."""
        return {
            "block_size": BLOCK,
            "buffer_steps": buffer_steps,
            "interval_s": interval_s,
            "streams": self.streams,
        }


def plan_fleet(
    requests: Sequence[TraceRequest], engines: int, capacity: int, clear_engine: int = 0
) -> FleetPlan:
    """Spread ``requests`` over ``engines`` (sticky per conversation) as their caches see them.

    A request stores the blocks past its engine's longest held prefix and
    touches that prefix; past ``capacity`` the engine evicts its least
    recently used blocks that no held block chains from (so every store names
    a held parent, as in vLLM, whose prefix hit is contiguous). Engine
    ``clear_engine`` clears its cache half way.
    """
    parent: dict[int, int | None] = {}
    last_use: list[dict[int, int]] = [{} for _ in range(engines)]
    children: list[Counter[int]] = [Counter() for _ in range(engines)]
    events: list[list[list[Any]]] = [[] for _ in range(engines)]
    fleet = FleetPlan([], [], parent)
    for n, req in enumerate(requests):
        if n == len(requests) // 2:
            events[clear_engine].append(["clear"])
            last_use[clear_engine].clear()
            children[clear_engine].clear()
            fleet.clears += 1
        i = instance_of(req, engines)
        ids = list(req.hash_ids)
        for k, h in enumerate(ids):
            parent.setdefault(h, ids[k - 1] if k else None)
        have, kids = last_use[i], children[i]
        first_new = 0
        while first_new < len(ids) and ids[first_new] in have:
            first_new += 1
        for h in ids:  # the prefix is touched, the rest stored
            have[h] = n
        new = ids[first_new:]
        for h in new:
            p = parent[h]
            if p is not None:
                kids[p] += 1
        if new:
            events[i].append(["store", new, ids[first_new - 1] if first_new else None])
            fleet.stored += len(new)
        protect = set(ids)
        gone: list[int] = []
        while len(have) > capacity:
            leaves = [h for h in have if kids[h] == 0 and h not in protect]
            if not leaves:
                break
            leaf = min(leaves, key=have.__getitem__)
            del have[leaf]
            p = parent[leaf]
            if p is not None:
                kids[p] -= 1
            gone.append(leaf)
        if gone:
            events[i].append(["remove", gone])
            fleet.removed += len(gone)
    for evs in events:
        # A batch is the events of PER_BATCH requests (a store and its evictions each).
        batches: list[list[list[Any]]] = []
        stores = 0
        for ev in evs:
            if not batches or (ev[0] == "store" and stores == PER_BATCH):
                batches.append([])
                stores = 0
            batches[-1].append(ev)
            stores += ev[0] == "store"
        fleet.streams.append(batches)
    fleet.held = [set(have) for have in last_use]
    return fleet


class Keys:
    """kvmesh content keys of trace block ids (chained from the prompt's start)."""

    def __init__(self, parent: dict[int, int | None]) -> None:
        self.parent = parent
        self.seed = namespace_seed(MODEL)
        self._memo: dict[int, int] = {}

    def of(self, h: int) -> int:
        """The key of trace block ``h``."""
        path: list[int] = []
        node: int | None = h
        while node is not None and node not in self._memo:
            path.append(node)
            node = self.parent.get(node)
        key = self.seed if node is None else self._memo[node]
        for b in reversed(path):
            key = chain_keys(key, trace_tokens([b])[0].tolist(), BLOCK)[0]
            self._memo[b] = key
        return self._memo[h]


# -- processes ------------------------------------------------------------------------


class EventStreams:
    """The vLLM publisher process (lab/engines/vllm_event_streams.py)."""

    def __init__(self, work: Path) -> None:
        self.sock_dir = work / "sock"
        self.sock_dir.mkdir(exist_ok=True)
        self.work = work
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.child = ChildProcess(
            [
                str(vllm_python()),
                "-m",
                "lab.engines.vllm_event_streams",
                "--dir",
                str(self.sock_dir),
            ],
            name="vllm event streams",
            env=env,
            log_path=work / "vllm-streams.log",
            pipes=True,
            die_with_parent=True,
        )

    def start(self) -> None:
        self.child.start()
        self._ready = False

    def wait_ready(self) -> None:
        if not self._ready:
            self.child.wait_line(180.0)  # importing vLLM takes seconds
            self._ready = True

    def command(self, line: str, answer: str, timeout_s: float = 60.0) -> None:
        self.child.send_line(line)
        got = self.child.wait_line(timeout_s, word="OK")
        assert got == answer, (line, got)

    def open(self, r: int, plan: dict[str, Any]) -> None:
        path = self.work / f"plan-{r}.json"
        path.write_text(json.dumps(plan), encoding="utf-8")
        self.command(f"open {r} {path}", f"open {r}", timeout_s=120.0)

    def endpoints(self, r: int, i: int) -> tuple[str, str]:
        return endpoints(str(self.sock_dir), r, i)


class BridgeProcess:
    """``kvmesh bridge --config FILE`` as a child process, and its metrics."""

    def __init__(self, name: str, config: dict[str, Any], work: Path) -> None:
        self.name = name
        self.metrics_port = free_port()
        config = {**config, "host": "127.0.0.1", "metrics_port": self.metrics_port}
        path = work / f"{name}.json"
        path.write_text(json.dumps(config), encoding="utf-8")
        self.child = ChildProcess(
            python_module("kvmesh.cli", "bridge", "--config", str(path)),
            name=name,
            log_path=work / f"{name}.log",
        )

    def metrics(self) -> dict[str, float]:
        """``kvmesh_bridge_*`` samples by name (``name{reason}`` for labelled ones)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.startswith("kvmesh_bridge_"):
                    label = s.labels.get("reason")
                    key = s.name.removeprefix("kvmesh_bridge_")
                    out[f"{key}{{{label}}}" if label else key] = s.value
        return out

    def start(self) -> None:
        self.child.start()
        self.child.wait_ready(lambda: bool(self.metrics()), timeout_s=60.0)


def bridge_config(
    i: int, streams: EventStreams, r: int, target: str, lb: str, buffer: int = BUFFER
) -> dict[str, Any]:
    pub, replay = streams.endpoints(r, i)
    return {
        "indexer": {
            "target": target,
            "load_balancing": lb,
            "ack_timeout_s": 5.0,
            "reconnect_backoff_s": 0.05,
            "reconnect_backoff_max_s": 0.5,
        },
        "engine_events": {
            "endpoints": [
                {
                    "worker_id": f"bridge-e{i}",
                    "model": MODEL,
                    "address": f"http://engine-{i}:8000",
                    "endpoint": pub,
                    "replay_endpoint": replay,
                    "lease_ttl_s": 60.0,
                }
            ],
            "replay_timeout_s": 2.0,
        },
        "buffer": {"max_batches": buffer},
        "incarnation_prefix": f"test-r{r}-e{i}",
        "log_level": "INFO",
    }


# -- reading the index ----------------------------------------------------------------


async def listed(stub: Any) -> dict[str, pb.InstanceInfo]:
    resp = await stub.ListInstances(pb.ListInstancesRequest(model=MODEL), timeout=5.0)
    return {info.instance.worker_id: info for info in resp.instances}


async def dumped(stub: Any) -> dict[str, set[int]]:
    """Worker id -> the block keys the index holds for it."""
    out: dict[str, set[int]] = {}
    async for resp in stub.DumpIndex(pb.DumpIndexRequest(model=MODEL), timeout=30.0):
        for b in resp.blocks:
            for h in b.holders:
                out.setdefault(h.instance.worker_id, set()).add(b.block_key)
    return out


def assert_index_is_truth(got: dict[str, set[int]], truth: dict[str, set[int]]) -> None:
    """Each worker's blocks in the index (``dumped``) are exactly the engine's."""
    for w, want in truth.items():
        have = got.get(w, set())
        assert have == want, (
            f"{w}: index holds {len(have)} blocks, the engine {len(want)}: "
            f"{len(have - want)} extra, {len(want - have)} missing"
        )


async def applied_through(stub: Any, last_seq: dict[str, int]) -> bool:
    """Whether each worker of ``last_seq`` is listed with batch ``last_seq[w]`` applied."""
    infos = await listed(stub)
    return all(
        w in infos and infos[w].has_applied_sequence and infos[w].applied_sequence == s
        for w, s in last_seq.items()
    )


async def wait_for(check: Any, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within_s:g} s")
        await asyncio.sleep(0.1)


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bridge")


@pytest.fixture(scope="module")
def streams(work: Path) -> Iterator[EventStreams]:
    s = EventStreams(work)
    s.start()
    try:
        yield s
    finally:
        stop_all([s.child])


@pytest.fixture(scope="module")
def fleet() -> FleetPlan:
    return plan_fleet(load_mooncake(limit=REQUESTS), ENGINES, CAPACITY)


@pytest.fixture
def redis_url() -> Iterator[str]:
    with RedisProcess() as proc:
        yield proc.url


def _figures(metrics: list[dict[str, float]]) -> dict[str, float]:
    names = (
        "batches_buffered_total",
        "batches_published_total",
        "events_published_total",
        "batches_applied_total",
        "batches_duplicate_total",
        "batches_rejected_total",
        "batches_dropped_total",
        "gaps_total",
        "replays_total",
        "batches_replayed_total",
        "unrecoverable_gaps_total",
        "batches_sent_total",
        "batches_resent_total",
        "stream_failures_total",
        "streams_opened_total",
        "registrations_total",
        "rebuilds_total",
    )
    return {n.removesuffix("_total"): sum(m.get(n, 0.0) for m in metrics) for n in names}


# -- the fleet test -------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_bridges_keep_the_index_exact_through_a_stall_and_a_replica_kill(
    redis_url: str, streams: EventStreams, fleet: FleetPlan, work: Path
) -> None:
    loop = asyncio.get_running_loop()
    a, b = (
        ReplicaProcess(redis_url, log_dir=str(work)),
        ReplicaProcess(redis_url, log_dir=str(work)),
    )
    await asyncio.gather(
        loop.run_in_executor(None, a.start),
        loop.run_in_executor(None, b.start),
        loop.run_in_executor(None, streams.wait_ready),
    )
    r = 0
    streams.open(r, fleet.plan())
    bridges = [
        BridgeProcess(
            f"bridge-{i}",
            bridge_config(
                i,
                streams,
                r,
                f"{a.target},{b.target}",
                "pick_first" if i < 2 else "round_robin",
            ),
            work,
        )
        for i in range(ENGINES)
    ]
    ch = grpc.aio.insecure_channel(b.target, options=CHANNEL_OPTIONS)
    stub = pb_grpc.IndexerServiceStub(ch)
    try:
        await wait_serving(a.target)
        await wait_serving(b.target)
        await asyncio.gather(*(loop.run_in_executor(None, br.start) for br in bridges))

        async def registered() -> bool:
            return len(await listed(stub)) == ENGINES

        await wait_for(registered, 30.0, "every bridge registered its engine")
        last_seq = {f"bridge-e{i}": len(s) - 1 for i, s in enumerate(fleet.streams)}
        stream_s = max(len(s) for s in fleet.streams) * INTERVAL_S

        streams.command(f"go {r}", f"go {r}")
        t0 = time.monotonic()
        await asyncio.sleep(stream_s * 0.2)
        for rep in (a, b):  # the whole indexer tier hangs for a while
            rep.child.signal_group(signal.SIGSTOP)
        await asyncio.sleep(STALL_S)
        for rep in (a, b):
            rep.child.signal_group(signal.SIGCONT)
        await asyncio.sleep(max(0.0, t0 + stream_s * 0.55 - time.monotonic()))
        at_kill = {w: info.applied_sequence for w, info in (await listed(stub)).items()}
        a.kill()  # the replica bridges 0 and 1 stream to
        killed_at = time.monotonic() - t0
        await loop.run_in_executor(None, lambda: streams.child.wait_line(120.0, word="OK"))

        await wait_for(
            lambda: applied_through(stub, last_seq), 45.0, "every engine's last batch applied"
        )
        done_s = time.monotonic() - t0

        # The index, block for block, is each engine's stores minus its removals.
        keys = Keys(fleet.parent)
        truth = {f"bridge-e{i}": {keys.of(h) for h in held} for i, held in enumerate(fleet.held)}
        got = await dumped(stub)
        assert_index_is_truth(got, truth)
        infos = await listed(stub)
        assert all(info.live and not info.stale for info in infos.values()), infos

        # Match agrees: every engine's depth for sampled prompts of the trace.
        prompts = [list(req.hash_ids) for req in load_mooncake(limit=REQUESTS)[::12]]
        for ids in prompts:
            req = pb.MatchRequest(
                model=MODEL, block_keys=[keys.of(h) for h in ids], max_blocks=len(ids)
            )
            resp = await stub.Match(req, timeout=5.0)
            answer = {m.instance.worker_id: m.depth for m in resp.matches}
            want_depths = {}
            for i, held in enumerate(fleet.held):
                d = 0
                while d < len(ids) and ids[d] in held:
                    d += 1
                if d:
                    want_depths[f"bridge-e{i}"] = d
            assert answer == want_depths, ids[:3]

        metrics = [br.metrics() for br in bridges]
        per_bridge = [_figures([m]) for m in metrics]
        total = _figures(metrics)
        print(
            "\nbridge fleet: "
            + json.dumps(
                {
                    "engines": ENGINES,
                    "engine_batches": sum(len(s) for s in fleet.streams),
                    "blocks_stored": fleet.stored,
                    "blocks_removed": fleet.removed,
                    "clears": fleet.clears,
                    "blocks_held_at_end": sum(len(t) for t in truth.values()),
                    "index_blocks_matching_truth": sum(len(got.get(w, ())) for w in truth),
                    "killed_at_s": round(killed_at, 2),
                    "caught_up_at_s": round(done_s, 2),
                    "applied_seq_at_kill": at_kill,
                    "total": total,
                    "per_bridge": per_bridge,
                },
                indent=1,
            )
        )
        # The faults struck mid-stream and did what they were meant to.
        assert any(at_kill.get(w, -1) < s for w, s in last_seq.items()), at_kill
        assert total["batches_dropped"] > 0 and total["batches_replayed"] > 0, total
        assert per_bridge[0]["stream_failures"] + per_bridge[1]["stream_failures"] >= 2, per_bridge
        assert total["unrecoverable_gaps"] == 0 and total["batches_rejected"] == 0, total
    finally:
        await ch.close()
        stop_all([br.child for br in bridges])
        a.stop()
        b.stop()
        streams.command(f"close {r}", f"close {r}")


# -- backpressure ---------------------------------------------------------------------


def _roots(r: int, n: int) -> list[int]:
    """Trace ids of ``n`` one-block chains of round ``r`` (roots of their own)."""
    return [(1 << 41) + r * 100_000 + k for k in range(n)]


async def _held_depths(stub: Any, ids: list[int]) -> list[int]:
    seed = namespace_seed(MODEL)
    out = []
    for h in ids:
        key = chain_keys(seed, trace_tokens([h])[0].tolist(), BLOCK)[0]
        resp = await stub.Match(pb.MatchRequest(model=MODEL, block_keys=[key]), timeout=5.0)
        out.append(max((m.depth for m in resp.matches), default=0))
    return out


@dataclass
class _Burst:
    bridge: Bridge
    ids: list[int]
    counters: dict[str, Any] = field(default_factory=dict)


async def _burst(
    streams: EventStreams, h: Any, index: GatedIndex, r: int, n: int, buffer_steps: int
) -> _Burst:
    """Round ``r``: one engine, ``n`` batches of a chain each, sent while applies wait."""
    ids = _roots(r, n)
    # The sidecar layout (helm/kvmesh/templates/_bridge.tpl): the bridge binds the events
    # socket on loopback and vLLM connects to it; vLLM binds its replay socket on loopback.
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = bridge_config(0, streams, r, h.server.address, "pick_first")
    (ep,) = cfg["engine_events"]["endpoints"]
    ep.update(endpoint=pub, replay_endpoint=replay, bind=True)
    cfg = {**cfg, "host": "127.0.0.1", "metrics_port": 0}
    bridge = await start_bridge(BridgeConfig.model_validate(cfg))
    streams.open(
        r,
        {
            "block_size": BLOCK,
            "buffer_steps": buffer_steps,
            "interval_s": 0.0,
            "streams": [[[["store", [h_], None]] for h_ in ids]],
            "endpoints": [[pub, replay]],
        },
    )
    iid = InstanceId("bridge-e0", 0)

    async def registered() -> bool:
        return any(
            s.spec.instance == iid and s.spec.incarnation.startswith(f"test-r{r}-")
            for s in await h.server.logic.list_instances(MODEL)
        )

    await wait_for(registered, 15.0, "the bridge registered its engine")
    index.gate.clear()  # the indexer stalls: the first batch waits, the buffer fills
    streams.command(f"go {r}", f"go {r}")
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, lambda: streams.child.wait_line(30.0, word="OK"))
    sub = bridge.subscribers.subscribers[0]
    assert sub.buffer is not None

    async def overflowed() -> bool:
        return sub.buffer is not None and sub.buffer.counters.dropped >= n - BUFFER - 2

    await wait_for(overflowed, 10.0, "the buffer dropped the burst past its bound")
    assert len(sub.buffer) <= BUFFER
    index.gate.set()

    async def settled() -> bool:
        return sub.next_seq == n and bridge.drained()

    await wait_for(settled, 20.0, "the bridge settled the dropped batches")
    return _Burst(bridge, ids, bridge.counters())


@pytest.fixture
async def gated() -> AsyncIterator[tuple[Any, GatedIndex]]:
    index = GatedIndex()
    h = await open_harness(make_config(block_size=BLOCK), index)
    try:
        yield h, index
    finally:
        index.gate.set()
        await close_harness(h)


@pytest.mark.timeout(90)
async def test_a_full_buffer_drops_and_the_bridge_recovers(
    streams: EventStreams, gated: tuple[Any, GatedIndex]
) -> None:
    h, index = gated
    await asyncio.get_running_loop().run_in_executor(None, streams.wait_ready)
    n = 40
    # The engine's replay buffer holds the whole burst: every drop comes back.
    got = await _burst(streams, h, index, 1, n, buffer_steps=1000)
    try:
        c = got.counters
        assert c["batches_dropped"] >= n - BUFFER - 2, c
        assert c["replays"] >= 1 and c["batches_replayed"] >= c["batches_dropped"], c
        assert c["unrecoverable_gaps"] == 0 and c["batches_rejected"] == 0, c
        assert await _held_depths(h.stub, got.ids) == [1] * n
    finally:
        await got.bridge.stop(0)
        streams.command("close 1", "close 1")

    # A replay buffer of 8 batches cannot return the drops: the instance is reset
    # (never left holding blocks the engine dropped) and the loss is counted.
    got = await _burst(streams, h, index, 2, n, buffer_steps=8)
    try:
        c = got.counters
        assert c["batches_dropped"] >= n - BUFFER - 2, c
        assert c["unrecoverable_gaps"] >= 1 and c["registrations"] >= 2, c
        depths = await _held_depths(h.stub, got.ids)
        assert depths[-8:] == [1] * 8, depths  # what the replay returned, after the reset
        assert sum(depths) <= 8 + BUFFER, depths  # nothing from before the reset survived
        (info,) = [
            s
            for s in await h.server.logic.list_instances(MODEL)
            if s.spec.instance.worker_id == "bridge-e0"
        ]
        assert not info.stale and info.applied_sequence == n - 1
    finally:
        await got.bridge.stop(0)
        streams.command("close 2", "close 2")
