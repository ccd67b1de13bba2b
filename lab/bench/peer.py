"""``kvmesh bench peer``: kvmesh's indexer beside NVIDIA Dynamo's, on vLLM's real event path.

The engine path end to end, the same for both sides:

- **Publishers**: ``--publishers`` real vLLM 0.33 ``ZmqEventPublisher``\\ s
  (64 by default) in ``--publisher-procs`` processes of the vLLM virtualenv
  (:class:`lab.bench.peer_procs.PublisherFleet`,
  ``lab/engines/vllm_publishers.py``). The bundled Mooncake conversation
  trace is spread over them as :mod:`lab.workload` does (sticky per
  conversation; each request stores the blocks its instance lacks, one
  ``BlockStored`` per request, ``--requests-per-batch`` requests per batch),
  with every 512-token trace block id expanded into 512 / ``--block-size``
  blocks of deterministic tokens. Every batch is encoded before the clock
  starts; each instance's stream ends with a sentinel batch.
- **Indexers**: ``kvmesh indexer serve`` (a child process with a config file
  of its own: one ZMQ subscriber per publisher, keys from tokens) on each
  ``--backend`` (memory; Redis on a private ``redis-server``; a private
  3-master Redis Cluster), and Dynamo's standalone indexer (``--peer
  dynamo``, ``ai-dynamo-runtime`` 1.6.1 in ``.venv-dynamo``, installed on
  first use), the same publishers registered through its ``/register``. Each
  side ingests its own fresh publishers carrying the identical stream, one
  side at a time, so no side shares the machine with another's ingest.

Per side, in order:

1. **Warm-up** (before any clock): every publisher stores a warm-up block
   until a query sees it at every instance: the subscriptions are live.
2. **Ingest** to "applied": from the cue to the publishers until the
   sentinel block is visible by query at every instance (polled every
   10 ms), then the index's own counters must say every batch (kvmesh
   ``GetStats``, duplicates included) or event (Dynamo
   ``dynamo_kvrouter_kv_cache_events_applied``, status ok) was applied;
   the errors they count meanwhile are a figure of their own. Blocks are
   (block, instance) pairs at ``--block-size``; CPU seconds are the indexer
   process's own (``/proc/<pid>/stat``, every thread); with Redis, the
   servers' CPU too (``INFO cpu``); "others' share" is the part of the
   machine's CPUs (``/proc/stat``) that neither the indexer, Redis, the
   publishers nor this client used: other work on a shared machine.
   Memory: the process's RSS and its growth per (block, instance); Redis
   ``used_memory`` growth per (block, instance). A Cluster's nodes get
   Redis's default ``cluster-node-timeout`` (15 s) instead of the lab's 1 s.
3. **Sequential Match**: ``--queries`` rounds of Match by token ids, Match
   by keys (kvmesh: its block keys; Dynamo: ``/query_by_hash`` with its own
   ``compute_block_hash_for_seq`` hashes) and the floor (kvmesh ``Ping``,
   Dynamo ``/health``), alternating call by call, one call in flight, over
   the same ``--prompts`` trace prompts of ``--prompt-blocks`` trace blocks
   (32 x 512 tokens: 32 blocks at 512-token blocks, 1,024 at 16). Bounded by
   ``--duration`` seconds. Every answer is checked against the reference
   model: a plain dict of the trace ids each instance holds (an instance
   holds all sub-blocks of an id or none), from which each instance's
   prefix depth follows; a wrong answer is any difference in who holds the
   prompt's first block or how deep.
4. **Match during ingest**: a second round of fresh publishers streams the
   same trace into a second model while a client sends, every
   ``--probe-interval`` seconds and on time whether or not the last one was
   answered, a Match by token ids against the first model (checked too),
   and with every fifth a health check (kvmesh ``grpc.health.v1``, Dynamo
   ``/health``). The bench's own collector is frozen first (``gc.freeze``):
   the trace, the plans and the expected answers it holds made one of its
   own collections pause it for up to 80 ms as the round began, and the
   probes then went out late and in a burst, which measured the bench, not
   the indexer (both sides alike).

   With ``--pin`` the indexer under test (kvmesh's, with its Redis, or
   Dynamo's) runs alone on the first CPU and the publishers and the probing
   client on the others, as when the indexer has a node of its own: on two
   cores, 64 publisher threads otherwise take the indexer's CPU share too.

   With ``--query-replica`` (Redis or Cluster) a second kvmesh replica over
   the same store, subscribed to no engine, answers the probes (and the
   sentinel polls): a fleet whose routers call replicas that do not ingest.
   Its CPU is counted apart (``query_replica_cpu_s_probed``), and the
   Matches it answered (``query_replica_matches_probed``).

5. **Redis's own limit** (standalone Redis only): the same number of
   (block, instance) pairs (at most 2 M) written as plain pipelined HSETs by
   ``redis-cli --pipe`` into the same server (:mod:`lab.bench.rawwrite`):
   pairs per second and ``used_memory`` per pair, and kvmesh's ingest as a
   share of that rate.

One table prints both sides and ``kvmesh / Dynamo`` ratios; ``--json FILE``
writes ``peer_<side>_<figure>`` and ``ratio_<backend>_<figure>`` figures
with the run's params. Dynamo's indexer binds 0.0.0.0, so a run with it
re-executes itself in a private network namespace (``unshare -rn``, loopback
only): every server of the run, kvmesh's and Redis included, is then
reachable from that namespace alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from indexer.config import IndexerConfig, Limits
from kvmesh.clihelp import HelpFormatter
from kvmesh.stats import percentile
from lab.bench.indexer import ClusterClient
from lab.bench.peer_procs import (
    Answer,
    DynamoSide,
    KvmeshSide,
    PublisherFleet,
    Query,
    Side,
    dynamo_hashes,
    dynamo_python,
    in_private_netns,
    run_in_private_netns,
    wait_until,
    worker_id,
)
from lab.bench.rawwrite import raw_pipelined_write
from lab.bench.report import fmt, table, write_report
from lab.children import ProcTimes
from lab.conformance import vllm_python
from lab.engines.vllm_publishers import (
    SENTINEL_ID,
    TRACE_BLOCK_TOKENS,
    WARMUP_ID,
    PlanEvent,
    trace_tokens,
)
from lab.redisproc import RedisClusterProcess, RedisProcess, free_port
from lab.traces import TraceRequest, load_mooncake
from lab.workload import instance_of

#: kvmesh backends a run may take, in the order they run.
BACKENDS = ("memory", "redis", "cluster")
#: Block sizes a run may take: each divides the trace's 512-token blocks.
BLOCK_SIZES = (16, 32, 64, 128, 256, 512)
#: kvmesh's default limits (indexer/config.py), which the bench raises only where
#: this stream needs it.
KVMESH_LIMITS = Limits()
#: ``cluster-node-timeout`` of the Cluster's nodes: Redis's default.
CLUSTER_NODE_TIMEOUT_MS = 15_000
#: Seconds the warm-up waits for a warm-up batch to show before sending another.
_WARM_WAIT_S = 2.0
#: Warm-up batches sent at most before the run gives up.
_WARM_ATTEMPTS = 15
#: Sequential calls of each kind before the timed ones.
_WARM_CALLS = 50
#: A health check goes with every fifth probe Match: 20 checks a second at the
#: default interval, far more than a kubelet sends, as in ``kvmesh bench indexer``.
HEALTH_EVERY = 5


@dataclass(frozen=True, slots=True)
class PeerParams:
    """What one run does."""

    block_size: int = 512
    backends: tuple[str, ...] = ("memory", "redis")
    peer: str = "dynamo"
    publishers: int = 64
    publisher_procs: int = 4
    requests: int | None = None
    requests_per_batch: int = 8
    queries: int = 2000
    prompts: int = 256
    prompt_blocks: int = 32
    duration_s: float = 60.0
    probe: bool = True
    probe_interval_s: float = 0.01
    #: kvmesh's probe Matches over one MatchStream (router_client's default path).
    probe_stream: bool = False
    #: Over Redis or a Cluster: the probes ask a second replica that ingests
    #: nothing (``--query-replica``), as a fleet with ingest and query replicas.
    query_replica: bool = False
    ingest_timeout_s: float = 900.0
    dynamo_threads: int = 2
    #: kvmesh config settings over the bench's (``--kvmesh-set``): (dotted key, value).
    kvmesh_set: tuple[tuple[str, Any], ...] = ()
    #: The indexer under test (with its Redis) on the first CPU alone, the
    #: publishers and the bench's own client on the others (``--pin``).
    pin: bool = False

    def cpu_sets(self) -> tuple[set[int], set[int]] | None:
        """With :attr:`pin`: (the indexer's CPUs, everyone else's); None without."""
        if not self.pin:
            return None
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("kvmesh bench peer --pin: needs two CPUs or more")
        return {cpus[0]}, set(cpus[1:])

    @property
    def sub_blocks(self) -> int:
        """Blocks per 512-token trace block."""
        return TRACE_BLOCK_TOKENS // self.block_size

    @property
    def sides(self) -> list[str]:
        """Every side of the run, the peer first."""
        return (["dynamo"] if self.peer == "dynamo" else []) + list(self.backends)


# -- the stream and the reference model ----------------------------------------------


@dataclass(slots=True)
class Stream:
    """What every side ingests: per instance, batches of events (:data:`PlanEvent`)."""

    block_size: int
    batches: list[list[list[PlanEvent]]]
    #: The reference model: the trace ids each instance holds once it is ingested.
    held: list[set[int]]
    pairs: int = 0  # (block, instance) pairs of the trace, at block_size
    events: int = 0
    batch_count: int = 0
    longest_event_blocks: int = 0

    @property
    def instances(self) -> int:
        """Instances (publishers) of the stream."""
        return len(self.batches)


def build_stream(
    trace: Sequence[TraceRequest], instances: int, requests_per_batch: int, block_size: int
) -> Stream:
    """Spread ``trace`` over ``instances`` as an engine fleet would publish it.

    Each request stores, on its conversation's instance
    (:func:`lab.workload.instance_of`), the blocks that instance does not
    hold yet, as one event; ``requests_per_batch`` consecutive events of an
    instance form a batch (one engine step announcing several requests).
    """
    sub = TRACE_BLOCK_TOKENS // block_size
    held: list[set[int]] = [set() for _ in range(instances)]
    events: list[list[PlanEvent]] = [[] for _ in range(instances)]
    stream = Stream(block_size, [], held)
    for req in trace:
        i = instance_of(req, instances)
        have = held[i]
        first_new = 0
        # Ids name prefixes: once one is missing, every later one is too.
        while first_new < len(req.hash_ids) and req.hash_ids[first_new] in have:
            first_new += 1
        new = list(req.hash_ids[first_new:])
        if not new:
            continue
        have.update(new)
        events[i].append((new, req.hash_ids[first_new - 1] if first_new else None))
        stream.pairs += len(new) * sub
        stream.events += 1
        stream.longest_event_blocks = max(stream.longest_event_blocks, len(new) * sub)
    for evs in events:
        batches = [evs[s : s + requests_per_batch] for s in range(0, len(evs), requests_per_batch)]
        stream.batches.append(batches)
        stream.batch_count += len(batches)
    return stream


def expected_answer(held: Sequence[set[int]], prompt: Sequence[int], sub_blocks: int) -> Answer:
    """What a correct index answers for ``prompt`` (trace ids): instance -> depth in blocks."""
    out: Answer = {}
    for i, have in enumerate(held):
        depth = 0
        while depth < len(prompt) and prompt[depth] in have:
            depth += 1
        if depth:
            out[i] = depth * sub_blocks
    return out


def sample_prompts(trace: Sequence[TraceRequest], length: int, count: int) -> list[list[int]]:
    """Up to ``count`` prompts: the first ``length`` ids of requests that have them, spread
    evenly over the trace (the longest requests, cut, when too few do)."""
    pool = [list(r.hash_ids[:length]) for r in trace if len(r.hash_ids) >= length]
    if len(pool) < count:
        longest = sorted(trace, key=lambda r: len(r.hash_ids), reverse=True)
        pool += [list(r.hash_ids[:length]) for r in longest if len(r.hash_ids) < length]
        pool = pool[:count]
    step = max(1, len(pool) // max(1, count))
    return pool[::step][:count]


def block_tokens(trace_id: int, block_size: int) -> list[int]:
    """Tokens of the first ``block_size``-token block of a trace id (warm-up, sentinel)."""
    return [int(t) for t in trace_tokens([trace_id])[0][:block_size]]


# -- measurements ----------------------------------------------------------------------


@dataclass(slots=True)
class Checked:
    """Answers checked against the reference model."""

    checked: int = 0
    wrong: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)

    def check(self, kind: str, k: int, got: Answer, want: Answer) -> None:
        """Count one answer; keep a few wrong ones (their differences) for the report."""
        self.checked += 1
        if got == want:
            return
        self.wrong += 1
        if len(self.examples) < 5:
            diff = {
                i: [want.get(i, 0), got.get(i, 0)]
                for i in sorted(set(got) | set(want))
                if got.get(i, 0) != want.get(i, 0)
            }
            self.examples.append({"kind": kind, "query": k, "instance: [want, got]": diff})


@dataclass(slots=True)
class Sequential:
    """Latencies (µs) of the sequential phase and its checks."""

    tokens_us: list[float] = field(default_factory=list)
    keys_us: list[float] = field(default_factory=list)
    floor_us: list[float] = field(default_factory=list)
    tokens: Checked = field(default_factory=Checked)
    keys: Checked = field(default_factory=Checked)

    def record(
        self,
        k: int,
        tokens: Answer,
        keys: Answer,
        ns: tuple[int, int, int],
        expected: Sequence[Answer],
    ) -> None:
        """Query ``k``'s two answers, checked, and their latencies from the three
        clock readings ``ns`` (before, between, after; nanoseconds)."""
        self.tokens_us.append((ns[1] - ns[0]) / 1000)
        self.keys_us.append((ns[2] - ns[1]) / 1000)
        self.tokens.check("tokens", k, tokens, expected[k])
        self.keys.check("keys", k, keys, expected[k])


def sequential(side: Side, expected: Sequence[Answer], calls: int, duration_s: float) -> Sequential:
    """Match by tokens, Match by keys and the floor, alternating call by call.

    Alternating makes the three see the same machine state. Checking is
    outside the timed calls.
    """
    out = Sequential()
    n = len(expected)
    for c in range(min(_WARM_CALLS, calls)):
        out.tokens.check("tokens", c % n, side.match_tokens(c % n), expected[c % n])
        out.keys.check("keys", c % n, side.match_keys(c % n), expected[c % n])
        side.floor()
    clock = time.perf_counter_ns
    stop_at = time.perf_counter() + duration_s
    for c in range(calls):
        k = c % n
        t0 = clock()
        a = side.match_tokens(k)
        t1 = clock()
        b = side.match_keys(k)
        t2 = clock()
        side.floor()
        out.floor_us.append((clock() - t2) / 1000)
        out.record(k, a, b, (t0, t1, t2), expected)
        if time.perf_counter() > stop_at:
            break
    return out


async def _stream_sequential(
    side: KvmeshSide, expected: Sequence[Answer], calls: int, duration_s: float
) -> Sequential:
    out = Sequential()
    n = len(expected)
    await side.stream_open()
    try:
        for c in range(min(_WARM_CALLS, calls)):
            out.tokens.check("tokens", c % n, await side.stream_tokens(c % n), expected[c % n])
            out.keys.check("keys", c % n, await side.stream_keys(c % n), expected[c % n])
        clock = time.perf_counter_ns
        stop_at = time.perf_counter() + duration_s
        for c in range(calls):
            k = c % n
            t0 = clock()
            a = await side.stream_tokens(k)
            t1 = clock()
            b = await side.stream_keys(k)
            out.record(k, a, b, (t0, t1, clock()), expected)
            if time.perf_counter() > stop_at:
                break
    finally:
        await side.stream_close()
    return out


def stream_sequential(
    side: KvmeshSide, expected: Sequence[Answer], calls: int, duration_s: float
) -> Sequential:
    """The sequential Matches again, one at a time over one MatchStream with
    router_client's own stream code (its default path), each awaited before
    the next: the per-call floor of a stream against a unary call's."""
    return asyncio.run(_stream_sequential(side, expected, calls, duration_s))


def _error_kind(e: Exception) -> str:
    """A failed call's gRPC status (with the start of its details), or its exception type."""
    code = getattr(e, "code", None)
    if callable(code):
        details = getattr(e, "details", None)
        text = details() if callable(details) else ""
        return f"{code().name}: {str(text or '')[:60]}"
    return type(e).__name__


@dataclass(slots=True)
class Probes:
    """Open-loop probes while a round ingests: a checked Match each interval, and a
    health check every :data:`HEALTH_EVERY` intervals."""

    side: Side
    expected: Sequence[Answer]
    interval_s: float
    timeout_s: float
    match_ms: list[float] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    checked: Checked = field(default_factory=Checked)
    errors: int = 0
    #: Failed probes by gRPC status (kvmesh) or exception type (Dynamo).
    error_kinds: dict[str, int] = field(default_factory=dict)
    _calls: set[asyncio.Task[None]] = field(default_factory=set)

    def _failed(self, e: Exception) -> None:
        self.errors += 1
        kind = _error_kind(e)
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    async def _match(self, k: int) -> None:
        t0 = time.perf_counter()
        try:
            got = await self.side.amatch_tokens(k, self.timeout_s)
        except Exception as e:
            self._failed(e)
            return
        self.match_ms.append((time.perf_counter() - t0) * 1000)
        self.checked.check("during ingest", k, got, self.expected[k])

    async def _health(self) -> None:
        t0 = time.perf_counter()
        try:
            await self.side.ahealth(self.timeout_s)
        except Exception as e:
            self._failed(e)
            return
        self.health_ms.append((time.perf_counter() - t0) * 1000)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def run(self, stop: asyncio.Event) -> None:
        """Probe until ``stop`` is set, then wait for every answer."""
        t, k = time.perf_counter(), 0
        while not stop.is_set():
            self._spawn(self._match(k % len(self.expected)))
            if k % HEALTH_EVERY == 0:
                self._spawn(self._health())
            k += 1
            t += self.interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, t - time.perf_counter()))
        await asyncio.gather(*self._calls)


@dataclass(slots=True)
class Ingested:
    """One ingest round: seconds to applied, the indexer's CPU seconds, the probes."""

    seconds: float
    #: CPU seconds in the round: ``indexer``, ``store`` (Redis), ``publishers``,
    #: ``client`` (this process), ``machine`` (every process), ``others``
    #: (the machine's less all of these: other work on the machine).
    cpu: dict[str, float]
    probes: Probes | None
    #: Sentinel polls that failed, by error (the index refused or timed out).
    poll_errors: dict[str, int] = field(default_factory=dict)
    #: What the index's counters grew by in the round.
    counters: dict[str, float] = field(default_factory=dict)
    #: The indexer process's CPU time, split, and page faults in the round.
    times: ProcTimes | None = None

    def kernel_figures(self, pairs: int, suffix: str = "") -> dict[str, float]:
        """The indexer's share of its CPU time in the kernel and its page faults
        per (block, instance): where first touches of memory are slow (a VM whose
        host takes back freed memory), they are much of the ingest's cost."""
        t = self.times
        if t is None or t.user_s + t.system_s <= 0:
            return {}
        out = {
            f"kernel_cpu_share{suffix}": t.system_s / (t.user_s + t.system_s),
            f"page_faults_per_block_instance{suffix}": t.minor_faults / pairs,
        }
        if t.minor_faults:
            # Kernel time over faults: about what a fault costs where faults are
            # most of it (an ingest makes few system calls a block).
            out[f"kernel_us_per_page_fault{suffix}"] = t.system_s / t.minor_faults * 1e6
        return out


def machine_busy_s() -> float | None:
    """CPU seconds every CPU of the machine has been busy since boot (``/proc/stat``)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    v = [int(x) for x in fields]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)  # not idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")


def free_page_reporting() -> bool | None:
    """Whether a virtio balloon of this machine reports free pages to its host
    (feature bit 5, ``VIRTIO_BALLOON_F_REPORTING``); None where it cannot be read.

    Where it does, the host takes back what the guest frees, and a page a
    process then touches for the first time waits for the host to give memory
    back: tens of µs a page instead of one or two. An indexer whose memory grows
    while it ingests pays that in the kernel (``kernel_cpu_share``,
    ``kernel_us_per_page_fault``), and how much depends on what the machine
    freed before the run.
    """
    drv = Path("/sys/bus/virtio/drivers/virtio_balloon")
    try:
        devices = [d for d in drv.iterdir() if d.name.startswith("virtio")]
        features = [(d / "features").read_text().strip() for d in devices]
    except OSError:
        return None if not drv.parent.exists() else False
    return any(len(f) > 5 and f[5] == "1" for f in features)


@contextlib.contextmanager
def _on_cpus(cpus: set[int] | None) -> Iterator[None]:
    """This thread on ``cpus`` (if given) for the block, then back where it was."""
    before = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


#: Iterations of :func:`cpu_calibration_ms`'s loop: about 130 ms of one CPU here.
_CALIBRATION_LOOP = 3_000_000


def cpu_calibration_ms(cpus: set[int] | None = None) -> float:
    """Milliseconds a fixed pure-Python loop takes (best of 5), on ``cpus`` if
    given (the indexer's, with ``--pin``).

    The same code ingested 310 k blocks/s in one run and 250 k an hour later,
    its rate per CPU-second falling with it, with no steal time reported and
    page faults no dearer: what a VM's host gives its vCPU (CPU share, memory
    bandwidth) may change with the hour, and the guest cannot see it. The
    loop, timed at the start and the end of a run, says how fast the machine
    was then: compare runs whose calibrations agree.
    """
    with _on_cpus(cpus):
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            acc = 0
            for i in range(_CALIBRATION_LOOP):
                acc += i * i
            best = min(best, time.perf_counter() - t0)
        return best * 1000


#: Keys of :func:`memory_calibration_ms`'s table, and lookups timed a pass.
_MEMORY_TABLE = 1_000_000
_MEMORY_LOOKUPS = 500_000


def memory_calibration_ms(cpus: set[int] | None = None) -> float:
    """Milliseconds of 500 k random lookups in a dict of a million int keys
    (best of 3; built untimed), on ``cpus`` if given: the index's own kind of
    work, bound by the machine's memory latency, which a host's other guests
    share and :func:`cpu_calibration_ms`'s loop does not touch."""
    with _on_cpus(cpus):
        rnd = random.Random(20261205)
        table = {rnd.getrandbits(63): i for i in range(_MEMORY_TABLE)}
        probe = rnd.sample(list(table), _MEMORY_LOOKUPS)
        get = table.get
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for k in probe:
                get(k)
            best = min(best, time.perf_counter() - t0)
        return best * 1000


@dataclass(slots=True)
class CpuMeter:
    """CPU seconds so far of everything a round involves, and of the whole machine."""

    side: Side
    fleet: PublisherFleet
    store: Any

    def read(self) -> dict[str, float]:
        """One reading (parts that cannot be read are left out)."""
        out = {"client": time.process_time()}
        parts: dict[str, float | None] = {
            "indexer": self.side.cpu_seconds(),
            "query": self.side.query_cpu_seconds(),
            "publishers": self.fleet.cpu_seconds(),
            "machine": machine_busy_s(),
        }
        if self.store is not None:
            parts["store"] = _store_figures(self.store)[1]
        out.update({k: v for k, v in parts.items() if v is not None})
        return out

    @staticmethod
    def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        """What each part used between two readings, and ``others``."""
        out = {k: after[k] - before[k] for k in after if k in before}
        if "machine" in out:
            ours = sum(v for k, v in out.items() if k != "machine")
            out["others"] = max(0.0, out["machine"] - ours)
        return out


async def _ingest(
    side: Side,
    fleet: PublisherFleet,
    r: int,
    model: str,
    sentinel: Sequence[int],
    params: PeerParams,
    probes: Probes | None,
    meter: CpuMeter,
) -> Ingested:
    await side.aopen()
    try:
        n = params.publishers
        poll_errors: dict[str, int] = {}
        stop = asyncio.Event()
        if probes is not None:
            # What this process holds is long-lived: no collection walks it
            # while the probes measure (see the module docstring, step 4).
            gc.collect()
            gc.freeze()
        cpu0 = meter.read()
        times0 = side.proc_times()
        t0 = time.perf_counter()
        fleet.go(r)
        probing = asyncio.create_task(probes.run(stop)) if probes is not None else None
        try:

            async def visible() -> bool:
                try:
                    return len(await side.aholders(model, sentinel)) >= n
                except Exception as e:  # an index too busy to answer: not seen yet
                    kind = _error_kind(e)
                    poll_errors[kind] = poll_errors.get(kind, 0) + 1
                    return False

            await wait_until(visible, params.ingest_timeout_s, f"{side.name} ingest round {r}")
            seconds = time.perf_counter() - t0
            cpu1 = meter.read()
            times1 = side.proc_times()
        finally:
            stop.set()
            if probing is not None:
                await probing
    finally:
        await side.aclose()
    times = times1 - times0 if times0 is not None and times1 is not None else None
    return Ingested(seconds, CpuMeter.spent(cpu0, cpu1), probes, poll_errors, times=times)


def ingest(
    side: Side,
    fleet: PublisherFleet,
    r: int,
    model: str,
    stream: Stream,
    params: PeerParams,
    meter: CpuMeter,
    probes: Probes | None = None,
) -> Ingested:
    """Stream round ``r`` into ``model`` and wait until the index applied all of it.

    "Applied": the sentinel (each instance's last batch) is visible at every
    instance, and the index's own counter of applied batches (kvmesh, a
    batch answered as a duplicate included: a retry of one whose answer was
    lost) or events (Dynamo, status ok) grew by what was sent (else
    ``RuntimeError``). What the counters say went wrong meanwhile is kept in
    ``Ingested.counters``.
    """
    sentinel = block_tokens(SENTINEL_ID, params.block_size)
    n = stream.instances
    want = stream.events + n if side.name == "dynamo" else stream.batch_count + n
    before = side.applied()
    done = asyncio.run(_ingest(side, fleet, r, model, sentinel, params, probes, meter))
    fleet.wait_sent(r, params.ingest_timeout_s)
    deadline = time.perf_counter() + 30.0
    while True:
        try:
            after = side.applied()
        except Exception:
            if time.perf_counter() > deadline:
                raise
            time.sleep(0.5)
            continue
        delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
        if delta["applied"] + delta.get("duplicate", 0.0) >= want:
            break
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{side.name}: counters say {delta} of {want} applied")
        time.sleep(0.05)
    done.counters = delta
    return done


def warm_up(side: Side, fleet: PublisherFleet, rounds: dict[int, str], block_size: int) -> int:
    """Send warm-up batches until a query sees the warm-up block at every instance of
    every round; return the batches it took (ZMQ drops what a PUB socket sends
    before a subscription reaches it; a later batch is a gap both indexers replay)."""
    tokens = block_tokens(WARMUP_ID, block_size)
    n = fleet.instances
    for attempt in range(1, _WARM_ATTEMPTS + 1):
        for r in rounds:
            fleet.command("warm", r)
        wait_to = time.perf_counter() + _WARM_WAIT_S
        while time.perf_counter() < wait_to:
            with contextlib.suppress(Exception):  # an index too busy to answer: not yet
                if all(len(side.holders(m, tokens)) >= n for m in rounds.values()):
                    return attempt
            time.sleep(0.05)
    raise TimeoutError(f"{side.name}: the warm-up block is not at every instance")


# -- one side ------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    """What every side of a run shares."""

    params: PeerParams
    stream: Stream
    fleet: PublisherFleet
    queries: list[Query]
    expected: list[Answer]
    work: Path
    notes: dict[str, Any] = field(default_factory=dict)
    #: With --pin: (the indexer's CPUs, everyone else's), read before any was set.
    pinned: tuple[set[int], set[int]] | None = None


def round_model(r: int) -> str:
    """Model (namespace) of round ``r``."""
    return f"peer-r{r}"


def kvmesh_config(run: Run, backend: str, url: str, rounds: Sequence[int]) -> dict[str, Any]:
    """The config file of ``kvmesh indexer serve``: defaults but for what this stream needs."""
    p, s = run.params, run.stream
    bs = p.block_size
    limits: dict[str, Any] = {}
    if s.longest_event_blocks > KVMESH_LIMITS.max_blocks_per_event:
        limits["max_blocks_per_event"] = s.longest_event_blocks
    # The default Match cap is what one message carries at this block size.
    cap = IndexerConfig(model_block_sizes={"m": bs}).limits.max_match_blocks
    query_blocks = p.prompt_blocks * p.sub_blocks
    if query_blocks > cap:
        raise ValueError(f"{query_blocks}-block queries exceed kvmesh's Match cap ({cap})")
    endpoints = [
        {
            "worker_id": worker_id(r, i),
            "model": round_model(r),
            "address": f"http://{worker_id(r, i)}:8000",
            "endpoint": ep,
            "replay_endpoint": rep,
        }
        for r in rounds
        for i, (ep, rep) in enumerate(run.fleet.endpoints(r))
    ]
    config: dict[str, Any] = {
        "backend": "memory" if backend == "memory" else "redis",
        "metrics_port": free_port(),
        "model_block_sizes": {round_model(r): bs for r in rounds},
        "engine_events": {"endpoints": endpoints},
        "log_level": "WARNING",
    }
    if limits:
        config["limits"] = limits
        run.notes["kvmesh_limits"] = limits
    if backend != "memory":
        config["redis"] = {"url": url, "cluster": backend == "cluster"}
    for key, value in p.kvmesh_set:
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return config


@contextlib.contextmanager
def _store(backend: str) -> Iterator[tuple[str, Any]]:
    """A private Redis (or Cluster) for ``backend`` and a client summing INFO over masters."""
    if backend not in ("redis", "cluster"):
        yield "", None
    elif backend == "redis":
        with RedisProcess() as rp:
            client = redis.Redis.from_url(rp.url)
            try:
                yield rp.url, client
            finally:
                client.close()
    else:
        with RedisClusterProcess() as rc:
            # The lab's clusters detect a failed node within a second (for failover
            # tests); a production cluster waits Redis's default 15 s. One apply
            # script at 16-token blocks can hold a master past a second, which a
            # 1 s timeout turns into CLUSTERDOWN.
            for node in rc.nodes:
                client = node.client()
                try:
                    client.config_set("cluster-node-timeout", CLUSTER_NODE_TIMEOUT_MS)
                finally:
                    client.close()
            cc = ClusterClient(rc.ports)
            try:
                yield rc.url, cc
            finally:
                cc.close()


def _store_figures(client: Any) -> tuple[float, float]:
    """Redis ``used_memory`` (bytes) and CPU seconds, summed over masters."""
    mem = float(client.info("memory")["used_memory"])
    cpu = client.info("cpu")
    return mem, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


#: Commands Redis logs in its SLOWLOG during the probed ingest: those over this.
SLOWLOG_OVER_US = 10_000


def _slowlog_start(client: Any) -> None:
    """Log every command over :data:`SLOWLOG_OVER_US` from now (Redis's own timing)."""
    client.config_set("slowlog-max-len", 8192)
    client.config_set("slowlog-log-slower-than", SLOWLOG_OVER_US)
    client.slowlog_reset()


def _slowlog_figures(client: Any) -> tuple[dict[str, float], dict[str, list[float]]]:
    """The longest command Redis ran since :func:`_slowlog_start` (every other
    client waited for it: a script holds the server) and how many took over
    :data:`SLOWLOG_OVER_US`; and by command (a script by its name): how many,
    the longest in ms."""
    from indexer.redis.scripts import load_scripts

    names = {
        s.sha.encode(): s.name for cluster in (False, True) for s in load_scripts(cluster).values()
    }
    got: list[int] = []
    by: dict[str, list[float]] = {}
    for e in client.slowlog_get(8192):
        us = int(e["duration"])
        got.append(us)
        words = bytes(e["command"]).split(b" ")
        name = words[0].decode(errors="replace").upper()
        if name == "EVALSHA" and len(words) > 1:
            name = names.get(words[1], "EVALSHA")
        row = by.setdefault(name, [0.0, 0.0])
        row[0] += 1
        row[1] = max(row[1], us / 1e3)
    figures = {
        "store_longest_command_ms": max(got, default=0) / 1e3,
        "store_commands_over_10ms": float(len(got)),
    }
    return figures, by


def _wait_registered(side: KvmeshSide, rounds: dict[int, str], n: int) -> None:
    """kvmesh registers an instance once its subscriber's socket connects."""
    deadline = time.perf_counter() + 120.0
    while True:
        with contextlib.suppress(Exception):  # an index too busy to answer: not yet
            if all(side.list_instances(m) >= n for m in rounds.values()):
                break
        if time.perf_counter() > deadline:
            raise TimeoutError("kvmesh: not every ZMQ subscriber connected")
        time.sleep(0.05)
    time.sleep(0.3)  # the subscriptions reach the PUB sockets just after the connects


def run_side(run: Run, kind: str, index: int, f: dict[str, float]) -> None:
    """Every measurement of one side, into ``f`` (without the ``peer_<side>_`` prefix):
    what was measured before a failure stays there."""
    p = run.params
    quiet, probed = 2 * index, 2 * index + 1
    rounds = {quiet: round_model(quiet)}
    if p.probe:
        rounds[probed] = round_model(probed)
    for r in rounds:
        run.fleet.command("open", r)
    # With --pin, what starts from here (the Redis, the indexer) inherits the
    # indexer's CPU; the bench goes back to the others once the side is up.
    pinned = run.pinned
    if pinned is not None:
        os.sched_setaffinity(0, pinned[0])
    try:
        with _store(kind) as (url, store):
            side: KvmeshSide | DynamoSide
            if kind == "dynamo":
                side = DynamoSide(run.work, p.block_size, p.dynamo_threads)
            else:
                side = KvmeshSide(
                    kind,
                    kvmesh_config(run, kind, url, list(rounds)),
                    run.work,
                    p.block_size,
                    query_replica=p.query_replica and kind != "memory",
                )
                side.probe_stream = p.probe_stream
            with side:
                if pinned is not None:
                    pin_threads(pinned[1])
                    run.notes[f"cpus_{kind}"] = sorted(os.sched_getaffinity(side.child.pid or 0))
                if isinstance(side, DynamoSide):
                    for r, m in rounds.items():
                        side.register(r, m, run.fleet.endpoints(r))
                else:
                    _wait_registered(side, rounds, p.publishers)
                f["warmup_batches"] = warm_up(side, run.fleet, rounds, p.block_size)
                side.prepare(rounds[quiet], run.queries)
                _measure(run, side, store, quiet, probed, rounds, f)
                if pinned is not None:
                    run.notes[f"cpus_bench_{kind}"] = sorted(thread_cpus())
    finally:
        if pinned is not None:
            pin_threads(pinned[1])
        for r in rounds:
            run.fleet.command("close", r)


def thread_cpus() -> set[int]:
    """The CPUs any thread of this process may run on."""
    cpus: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            cpus |= os.sched_getaffinity(int(tid))
    return cpus


def pin_threads(cpus: set[int]) -> None:
    """Every thread of this process to ``cpus``, not only the calling one.

    ``sched_setaffinity`` moves one thread, and a thread takes its creator's
    CPUs: grpc's own threads, started while the bench was on the indexer's
    CPU to start it, would stay there, and the probing client's completions
    would wait behind the indexer they measure.
    """
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


def _measure(
    run: Run,
    side: Side,
    store: Any,
    quiet: int,
    probed: int,
    rounds: dict[int, str],
    f: dict[str, float],
) -> None:
    p, s = run.params, run.stream
    stored = s.pairs + s.instances  # the trace and the sentinels
    rss0 = side.rss_bytes()
    mem0 = _store_figures(store)[0] if store is not None else 0.0
    meter = CpuMeter(side, run.fleet, store)
    cpus = os.cpu_count() or 1
    done = ingest(side, run.fleet, quiet, rounds[quiet], s, p, meter)
    if done.poll_errors:
        run.notes[f"sentinel_poll_errors_{side.name}"] = done.poll_errors
    f["ingest_s"] = done.seconds
    f["apply_errors"] = done.counters.get("errors", 0.0)
    if "duplicate" in done.counters:
        f["apply_duplicates"] = done.counters["duplicate"]
    f["ingest_blocks_per_s"] = s.pairs / done.seconds
    cpu = done.cpu
    if cpu.get("indexer"):
        f["ingest_cpu_s"] = cpu["indexer"]
        f["ingest_blocks_per_cpu_s"] = s.pairs / cpu["indexer"]
    f.update(done.kernel_figures(s.pairs))
    if "publishers" in cpu:
        f["publishers_cpu_s"] = cpu["publishers"]
    if "others" in cpu:
        f["others_cpu_share"] = cpu["others"] / (done.seconds * cpus)
    rss1 = side.rss_bytes()
    if rss0 is not None and rss1 is not None:
        f["rss_mb"] = rss1 / (1024 * 1024)
        f["rss_bytes_per_block_instance"] = (rss1 - rss0) / stored
    if store is not None:
        f["store_bytes_per_block_instance"] = (_store_figures(store)[0] - mem0) / stored
        if isinstance(store, ClusterClient):
            # How evenly the chains' anchors spread the index over the masters.
            f["store_key_share_max"] = store.key_share_max()
            f["store_memory_share_max"] = store.memory_share_max()
        if "store" in cpu:
            f["store_cpu_s"] = cpu["store"]
            if cpu.get("indexer"):
                f["ingest_blocks_per_cpu_s_with_store"] = s.pairs / (cpu["indexer"] + cpu["store"])
    seq = sequential(side, run.expected, p.queries, p.duration_s)
    for name, lat in (("tokens", seq.tokens_us), ("keys", seq.keys_us), ("floor", seq.floor_us)):
        prefix = "floor" if name == "floor" else f"match_{name}"
        f[f"{prefix}_p50_us"] = percentile(lat, 0.5)
        f[f"{prefix}_p99_us"] = percentile(lat, 0.99)
    f["sequential_calls"] = float(len(seq.tokens_us))
    f["wrong_tokens"] = float(seq.tokens.wrong)
    f["wrong_keys"] = float(seq.keys.wrong)
    f["answers_checked"] = float(seq.tokens.checked + seq.keys.checked)
    examples = seq.tokens.examples + seq.keys.examples
    if isinstance(side, KvmeshSide):
        st = stream_sequential(side, run.expected, p.queries, p.duration_s)
        for name, lat in (("tokens", st.tokens_us), ("keys", st.keys_us)):
            f[f"match_{name}_stream_p50_us"] = percentile(lat, 0.5)
            f[f"match_{name}_stream_p99_us"] = percentile(lat, 0.99)
        f["wrong_tokens"] += st.tokens.wrong
        f["wrong_keys"] += st.keys.wrong
        f["answers_checked"] += st.tokens.checked + st.keys.checked
        examples += st.tokens.examples + st.keys.examples
    if p.probe:
        probes = Probes(side, run.expected, p.probe_interval_s, 60.0)
        if isinstance(store, (redis.Redis, ClusterClient)):
            _slowlog_start(store)
        asked0 = side.query_matches() if isinstance(side, KvmeshSide) else None
        during = ingest(side, run.fleet, probed, rounds[probed], s, p, meter, probes)
        if asked0 is not None and isinstance(side, KvmeshSide):
            f["query_replica_matches_probed"] = float((side.query_matches() or 0) - asked0)
        if isinstance(store, (redis.Redis, ClusterClient)):
            slow, by = _slowlog_figures(store)
            f.update(slow)
            if by:
                run.notes[f"redis_commands_over_10ms_{side.name}"] = by
        f["ingest_probed_blocks_per_s"] = s.pairs / during.seconds
        f.update(during.kernel_figures(s.pairs, "_probed"))
        if during.cpu.get("indexer"):
            f["ingest_probed_blocks_per_cpu_s"] = s.pairs / during.cpu["indexer"]
        if "query" in during.cpu:
            f["query_replica_cpu_s_probed"] = during.cpu["query"]
        if "others" in during.cpu:
            f["others_cpu_share_probed"] = during.cpu["others"] / (during.seconds * cpus)
        if during.poll_errors:
            run.notes[f"sentinel_poll_errors_probed_{side.name}"] = during.poll_errors
        f["match_during_ingest_p50_ms"] = percentile(probes.match_ms, 0.5)
        f["match_during_ingest_p99_ms"] = percentile(probes.match_ms, 0.99)
        f["health_during_ingest_p50_ms"] = percentile(probes.health_ms, 0.5)
        f["health_during_ingest_p99_ms"] = percentile(probes.health_ms, 0.99)
        f["wrong_during_ingest"] = float(probes.checked.wrong)
        f["probe_errors"] = float(probes.errors)
        f["answers_checked"] += probes.checked.checked
        examples += probes.checked.examples
        if probes.error_kinds:
            run.notes[f"probe_errors_{side.name}"] = probes.error_kinds
    if examples:
        run.notes[f"wrong_examples_{side.name}"] = examples
    if isinstance(store, redis.Redis):
        # The physical limit: the same pairs as plain pipelined HSETs (lab/bench/rawwrite.py).
        kw = store.connection_pool.connection_kwargs
        raw = raw_pipelined_write(kw["host"], int(kw["port"]), s.pairs, s.instances)
        f["raw_write_pairs_per_s"] = raw.pairs_per_s
        f["raw_write_bytes_per_pair"] = raw.bytes_per_pair
        f["ingest_vs_raw_write"] = f["ingest_blocks_per_s"] / raw.pairs_per_s


# -- report ----------------------------------------------------------------------------

#: (row label, figure, unit); a ratio column for each kvmesh backend.
_ROWS: tuple[tuple[str, str, str], ...] = (
    ("ingest", "ingest_blocks_per_s", "blocks/s"),
    ("ingest per indexer CPU-s", "ingest_blocks_per_cpu_s", "blocks/s"),
    ("  same, with Redis's CPU", "ingest_blocks_per_cpu_s_with_store", "blocks/s"),
    ("ingest to applied", "ingest_s", "s"),
    ("apply errors (kvmesh: retried)", "apply_errors", ""),
    ("batches applied as duplicates", "apply_duplicates", ""),
    ("indexer CPU during ingest", "ingest_cpu_s", "s"),
    ("  share in the kernel", "kernel_cpu_share", ""),
    ("  page faults / (block, inst)", "page_faults_per_block_instance", ""),
    ("  kernel time / page fault", "kernel_us_per_page_fault", "µs"),
    ("others' share of the CPUs", "others_cpu_share", ""),
    ("floor p50 (/health vs Ping)", "floor_p50_us", "µs"),
    ("floor p99", "floor_p99_us", "µs"),
    ("Match by token ids p50", "match_tokens_p50_us", "µs"),
    ("Match by token ids p99", "match_tokens_p99_us", "µs"),
    ("Match by keys p50 (by hash)", "match_keys_p50_us", "µs"),
    ("Match by keys p99", "match_keys_p99_us", "µs"),
    ("MatchStream, token ids p50", "match_tokens_stream_p50_us", "µs"),
    ("MatchStream, token ids p99", "match_tokens_stream_p99_us", "µs"),
    ("MatchStream, keys p50", "match_keys_stream_p50_us", "µs"),
    ("MatchStream, keys p99", "match_keys_stream_p99_us", "µs"),
    ("wrong answers, token ids", "wrong_tokens", ""),
    ("wrong answers, keys", "wrong_keys", ""),
    ("ingest while probed", "ingest_probed_blocks_per_s", "blocks/s"),
    ("  per indexer CPU-s", "ingest_probed_blocks_per_cpu_s", "blocks/s"),
    ("  others' share of the CPUs", "others_cpu_share_probed", ""),
    ("  query replica's CPU", "query_replica_cpu_s_probed", "s"),
    ("  indexer CPU in the kernel", "kernel_cpu_share_probed", ""),
    ("  page faults / (block, inst)", "page_faults_per_block_instance_probed", ""),
    ("  kernel time / page fault", "kernel_us_per_page_fault_probed", "µs"),
    ("Match p50 during ingest", "match_during_ingest_p50_ms", "ms"),
    ("Match p99 during ingest", "match_during_ingest_p99_ms", "ms"),
    ("health p50 during ingest", "health_during_ingest_p50_ms", "ms"),
    ("health p99 during ingest", "health_during_ingest_p99_ms", "ms"),
    ("wrong answers during ingest", "wrong_during_ingest", ""),
    ("longest Redis command, ingest", "store_longest_command_ms", "ms"),
    ("Redis commands over 10 ms", "store_commands_over_10ms", ""),
    ("failed probes", "probe_errors", ""),
    ("indexer RSS after ingest", "rss_mb", "MB"),
    ("RSS growth / (block, inst)", "rss_bytes_per_block_instance", "B"),
    ("Redis bytes / (block, inst)", "store_bytes_per_block_instance", "B"),
    ("largest master's key share", "store_key_share_max", ""),
    ("  its memory share", "store_memory_share_max", ""),
    ("Redis raw pipelined HSETs", "raw_write_pairs_per_s", "pairs/s"),
    ("  ingest ÷ raw write", "ingest_vs_raw_write", ""),
    ("  raw write bytes / pair", "raw_write_bytes_per_pair", "B"),
)

#: Figures that get a ``ratio_`` (kvmesh ÷ Dynamo): rates, latencies, memory.
#: kvmesh's Matches over a MatchStream against Dynamo's over HTTP (it has no
#: stream): each call one request, awaited before the next, on both sides.
STREAM_VS_UNARY = {
    f"match_{kind}_stream_{q}_us": f"match_{kind}_{q}_us"
    for kind in ("tokens", "keys")
    for q in ("p50", "p99")
}
RATIO_FIGURES = tuple(
    name
    for _, name, unit in _ROWS
    if unit
    and name
    not in (
        "ingest_s",
        "ingest_cpu_s",
        "kernel_us_per_page_fault",
        "kernel_us_per_page_fault_probed",
    )
)


def ratios(figures: dict[str, float], backends: Sequence[str]) -> dict[str, float]:
    """``ratio_<backend>_<figure>``: kvmesh's figure over Dynamo's, where both exist."""
    out: dict[str, float] = {}
    for b in backends:
        for name in RATIO_FIGURES:
            theirs = figures.get(f"peer_dynamo_{STREAM_VS_UNARY.get(name, name)}")
            ours = figures.get(f"peer_{b}_{name}")
            if ours is not None and theirs:
                out[f"ratio_{b}_{name}"] = ours / theirs
    return out


def format_table(figures: dict[str, float], sides: Sequence[str]) -> str:
    """Both sides side by side, then kvmesh ÷ Dynamo for each backend."""
    backends = [s for s in sides if s != "dynamo"]
    ratio_cols = backends if "dynamo" in sides else []
    head = f"{'figure':<30} {'unit':<8}" + "".join(f" {s:>10}" for s in sides)
    head += "".join(f" {s[:3] + '/dyn':>8}" for s in ratio_cols)
    lines = []
    for label, name, unit in _ROWS:
        values = [figures.get(f"peer_{s}_{name}") for s in sides]
        if all(v is None for v in values):
            continue
        line = f"{label:<30} {unit:<8}" + "".join(f" {fmt(v):>10}" for v in values)
        for b in ratio_cols:
            r = figures.get(f"ratio_{b}_{name}")
            line += f" {(f'{r:.2f}' if r is not None else '-'):>8}"
        lines.append(line)
    return table(head, lines)


# -- entry point -------------------------------------------------------------------------


def run_bench(
    params: PeerParams, log_dir: str | None = None
) -> tuple[dict[str, float], dict[str, Any]]:
    """Run every side; return ``(figures, params)`` as written to JSON.

    ``log_dir``: keep every process's log (and the configs) there.
    """
    trace = load_mooncake(limit=params.requests)
    stream = build_stream(trace, params.publishers, params.requests_per_batch, params.block_size)
    prompts = sample_prompts(trace, params.prompt_blocks, params.prompts)
    expected = [expected_answer(stream.held, q, params.sub_blocks) for q in prompts]
    queries = [Query([int(t) for t in trace_tokens(q).reshape(-1)]) for q in prompts]
    figures: dict[str, float] = {}
    # With --pin, the loop runs on the indexer's CPU (before the bench leaves it).
    cal_cpus = (params.cpu_sets() or (None,))[0]
    calibration = [cpu_calibration_ms(cal_cpus)]
    mem_calibration = [memory_calibration_ms(cal_cpus)]
    with tempfile.TemporaryDirectory(prefix="kvpeer-") as tmp:
        work = Path(tmp)
        if log_dir is not None:
            # ipc:// paths stay short in the temporary folder; the logs go where asked.
            work = Path(log_dir)
            work.mkdir(parents=True, exist_ok=True)
        if params.peer == "dynamo":
            hashes = dynamo_hashes([q.tokens for q in queries], params.block_size, Path(tmp))
            for q, h in zip(queries, hashes, strict=True):
                q.dynamo_hashes = h
        plan = {"block_size": params.block_size, "streams": stream.batches}
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(json.dumps(plan), encoding="utf-8")
        sock = Path(tmp) / "sock"
        sock.mkdir()
        procs = max(1, min(params.publisher_procs, params.publishers))
        pinned = params.cpu_sets()
        if pinned is not None:
            os.sched_setaffinity(0, pinned[1])  # the publishers inherit it
        t0 = time.perf_counter()
        with PublisherFleet(plan_path, params.publishers, procs, sock, work) as fleet:
            run = Run(params, stream, fleet, queries, expected, work, pinned=pinned)
            run.notes["publisher_start_s"] = round(time.perf_counter() - t0, 1)
            if pinned is not None:
                run.notes["cpus_publishers"] = sorted(
                    {c for pr in fleet.procs for c in os.sched_getaffinity(pr.pid or 0)}
                )
            run.notes["publisher_encode_s"] = [r["encode_s"] for r in fleet.ready]
            run.notes["encoded_bytes"] = sum(int(r["bytes"]) for r in fleet.ready)
            run.notes["vllm"] = fleet.ready[0]["vllm"]
            for index, kind in enumerate(params.sides):
                print(f"kvmesh bench peer: {kind} ...", flush=True)
                side_figures: dict[str, float] = {}
                try:
                    run_side(run, kind, index, side_figures)
                except Exception as e:  # the other sides still run; the exit code says so
                    traceback.print_exc()
                    run.notes[f"failed_{kind}"] = f"{type(e).__name__}: {e}"[:600]
                figures.update({f"peer_{kind}_{k}": v for k, v in side_figures.items()})
    figures.update(ratios(figures, params.backends))
    calibration.append(cpu_calibration_ms(cal_cpus))
    mem_calibration.append(memory_calibration_ms(cal_cpus))
    run_params: dict[str, Any] = {
        **{k: v for k, v in asdict(params).items()},
        "trace": "mooncake_conversation_trace",
        "trace_requests": len(trace),
        "block_instances": stream.pairs,
        "events": stream.events,
        "batches": stream.batch_count,
        "longest_event_blocks": stream.longest_event_blocks,
        "query_blocks": params.prompt_blocks * params.sub_blocks,
        "distinct_prompts": len(prompts),
        "dynamo": "ai-dynamo-runtime 1.6.1, python -m dynamo.indexer" if params.peer else "",
        "client": "one Python process: grpc blocking stub / http.client keep-alive, one call "
        "in flight; probes: grpc.aio / aiohttp",
        "cpus": os.cpu_count(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "free_page_reporting": free_page_reporting(),
        "cpu_calibration_ms": [round(c, 1) for c in calibration],
        "memory_calibration_ms": [round(c, 1) for c in mem_calibration],
        "python": platform.python_version(),
        **run.notes,
    }
    return figures, run_params


def _parse(argv: Sequence[str] | None) -> tuple[PeerParams, str | None, str | None]:
    p = argparse.ArgumentParser(
        prog="kvmesh bench peer",
        description="kvmesh's indexer beside Dynamo's standalone KV indexer, fed by real vLLM "
        "ZmqEventPublishers with the identical stream.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--json", dest="json_path", help="also write figures and params here")
    p.add_argument("--log-dir", help="keep the processes' logs and configs in this folder")
    p.add_argument(
        "--block-size", type=int, default=512, choices=BLOCK_SIZES, help="tokens per block"
    )
    p.add_argument(
        "--backend",
        default="memory,redis",
        help="kvmesh backends, comma-separated: memory, redis, cluster",
    )
    p.add_argument(
        "--peer",
        choices=("dynamo", "none"),
        default="dynamo",
        help="the indexer beside kvmesh's (none: kvmesh's alone)",
    )
    p.add_argument("--publishers", type=int, default=64, help="vLLM publishers (instances)")
    p.add_argument("--publisher-procs", type=int, default=4, help="processes they share")
    p.add_argument("--requests", type=int, help="trace requests streamed (default: all)")
    p.add_argument(
        "--requests-per-batch",
        type=int,
        default=8,
        help="events (one per trace request) in each batch a publisher sends",
    )
    p.add_argument("--queries", type=int, default=2000, help="sequential rounds per side")
    p.add_argument("--prompts", type=int, default=256, help="distinct prompts they cycle over")
    p.add_argument(
        "--prompt-blocks", type=int, default=32, help="512-token trace blocks per prompt"
    )
    p.add_argument(
        "--duration", type=float, default=60.0, help="longest sequential phase per side, seconds"
    )
    p.add_argument("--no-probe", action="store_true", help="skip the Match-during-ingest round")
    p.add_argument("--probe-interval", type=float, default=0.01, help="seconds between probes")
    p.add_argument(
        "--probe-stream",
        action="store_true",
        help="kvmesh's probe Matches over one MatchStream, as router_client sends them "
        "(default: one unary Match each, as Dynamo's are one HTTP request each)",
    )
    p.add_argument(
        "--query-replica",
        action="store_true",
        help="over redis or cluster, the probes during an ingest ask a second replica "
        "that subscribes to no engine (ingest and routers' calls on separate replicas)",
    )
    p.add_argument("--dynamo-threads", type=int, default=2, help="dynamo.indexer --threads")
    p.add_argument(
        "--pin",
        action="store_true",
        help="the indexer under test (and its Redis) alone on the first CPU, the publishers "
        "and the bench's client on the others, as when the indexer has a node of its own "
        "(default: every process on every CPU)",
    )
    p.add_argument(
        "--kvmesh-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a kvmesh indexer setting over the bench's, dotted key, JSON or text value "
        "(repeatable), e.g. redis.socket_timeout_s=5 (default: none)",
    )
    args = p.parse_args(argv)
    kvmesh_set: list[tuple[str, Any]] = []
    for item in args.kvmesh_set:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            p.error(f"--kvmesh-set {item!r}: not KEY=VALUE")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        kvmesh_set.append((key, value))
    backends = tuple(b.strip() for b in args.backend.split(",") if b.strip())
    bad = [b for b in backends if b not in BACKENDS]
    if bad or len(set(backends)) != len(backends):
        p.error(f"--backend: one or more of {', '.join(BACKENDS)}, each once")
    for name in ("publishers", "publisher_procs", "queries", "prompts", "prompt_blocks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.requests is not None and args.requests < 1:
        p.error("--requests must be >= 1")
    if not backends and args.peer == "none":
        p.error("nothing to run: no backend and --peer none")
    ordered = tuple(b for b in BACKENDS if b in backends)
    params = PeerParams(
        block_size=args.block_size,
        backends=ordered,
        peer=args.peer if args.peer != "none" else "",
        publishers=args.publishers,
        publisher_procs=args.publisher_procs,
        requests=args.requests,
        requests_per_batch=args.requests_per_batch,
        queries=args.queries,
        prompts=args.prompts,
        prompt_blocks=args.prompt_blocks,
        duration_s=args.duration,
        probe=not args.no_probe,
        probe_interval_s=args.probe_interval,
        probe_stream=args.probe_stream,
        query_replica=args.query_replica,
        dynamo_threads=args.dynamo_threads,
        kvmesh_set=tuple(kvmesh_set),
        pin=args.pin,
    )
    return params, args.json_path, args.log_dir


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh bench peer``; returns the exit code."""
    argv = list(argv if argv is not None else sys.argv[1:])
    params, json_path, log_dir = _parse(argv)
    if params.peer == "dynamo" and not in_private_netns():
        # Installs need the network, which the private namespace does not have.
        dynamo_python(install=True)
        vllm_python()
        return run_in_private_netns("lab.bench.peer", argv)
    t0 = time.perf_counter()
    figures, run_params = run_bench(params, log_dir)
    sides = params.sides
    print(
        f"kvmesh bench peer: {params.block_size}-token blocks, {run_params['block_instances']:,} "
        f"(block, instance) pairs from {run_params['trace_requests']:,} requests over "
        f"{params.publishers} vLLM publishers in {min(params.publisher_procs, params.publishers)} "
        f"processes; {run_params['query_blocks']}-block queries; {os.cpu_count()} cpus"
        f"{' (the indexer under test pinned alone to one)' if params.pin else ''}, load "
        f"{run_params['load_average_at_end'][0]}; {time.perf_counter() - t0:.0f} s"
    )
    print(format_table(figures, sides))
    if run_params["free_page_reporting"]:
        print(
            "machine: a VM whose host takes back the memory it frees (virtio-balloon free "
            "page reporting): a page touched for the first time may wait for the host"
        )
    cal, mem = run_params["cpu_calibration_ms"], run_params["memory_calibration_ms"]
    print(
        f"machine: a fixed Python loop took {cal[0]} ms at the start and {cal[-1]} ms at the "
        f"end, 500 k random dict lookups {mem[0]} and {mem[-1]} ms (cpu_calibration_ms, "
        "memory_calibration_ms: compare runs whose figures agree)"
    )
    if not params.pin and params.probe and (os.cpu_count() or 1) > 1:
        print(
            "machine: each indexer shares the CPUs with the publishers (a thread per "
            "engine): its figures during ingest include the CPU they take from it; "
            "--pin gives the indexer under test a CPU of its own"
        )
    for note in _notes(run_params):
        print(note)
    if json_path:
        write_report(json_path, figures, run_params)
    wrong = sum(v for k, v in figures.items() if "_wrong_" in k)
    bad = [k for k, v in figures.items() if not math.isfinite(v)]
    failed = [k for k in run_params if k.startswith("failed_")]
    return 1 if wrong or bad or failed else 0


def _notes(run_params: dict[str, Any]) -> list[str]:
    out = []
    if run_params.get("kvmesh_set"):
        out.append(f"kvmesh settings given with --kvmesh-set: {run_params['kvmesh_set']}")
    if "kvmesh_limits" in run_params:
        out.append(
            f"kvmesh config beyond its defaults: limits {run_params['kvmesh_limits']} "
            f"(this stream's longest event: {run_params['longest_event_blocks']:,} blocks)"
        )
    for key, value in run_params.items():
        if key.startswith("wrong_examples_"):
            out.append(f"WRONG answers ({key.removeprefix('wrong_examples_')}): {value}")
        if key.startswith("probe_errors_"):
            out.append(f"failed probes ({key.removeprefix('probe_errors_')}): {value}")
        if key.startswith("sentinel_poll_errors_"):
            side = key.removeprefix("sentinel_poll_errors_")
            out.append(f"sentinel polls refused during ingest ({side}): {value}")
        if key.startswith("failed_"):
            out.append(f"FAILED ({key.removeprefix('failed_')}): {value}")
        if key.startswith("redis_commands_over_10ms_"):
            side = key.removeprefix("redis_commands_over_10ms_")
            rows = ", ".join(f"{k} {int(n)} (longest {ms:.1f} ms)" for k, (n, ms) in value.items())
            out.append(f"Redis commands over 10 ms during the probed ingest ({side}): {rows}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
