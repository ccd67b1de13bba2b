"""Conformance of the indexer's answers with vLLM's own prefix cache.

For every request a real vLLM engine admits, the prefix kvmesh says that
engine would reuse must be the prefix vLLM's scheduler-side KV cache manager
does reuse. The engine side is ``lab/engines/vllm_engine.py``, run with the
interpreter of a separate virtualenv that has vLLM (:func:`vllm_python`):
vLLM's ``KVCacheManager`` over a small pool, its events published by vLLM's
own ``ZmqEventPublisher``. This side starts real indexers (one per backend:
memory, and Redis on a private ``redis-server``) subscribed to the engines'
streams (``engine_events.endpoints``, the default settings: ``keys:
tokens``, ``on_unrecoverable_gap: reset``), and for each announced request:

1. waits until every indexer has processed the last batch the engine
   published before its lookup (:func:`wait_processed`);
2. asks ``Match`` over gRPC with the query :func:`query_for` builds from the
   announcement;
3. turns the engine instance's depth into tokens and compares it with
   vLLM's ``get_computed_blocks`` (:func:`predicted_tokens`, :func:`classify`).

**How tokens are counted.** vLLM reuses whole blocks only, and never the
whole prompt: ``get_computed_blocks`` caps the hit at ``num_tokens - 1``
("the last token must be recomputed to get logits"), and the hit ends on a
block boundary. kvmesh's answer in tokens is therefore ``min(depth x B,
floor((n - 1) / B) x B)`` for an ``n``-token request and the indexer's block
size ``B``: a router that followed kvmesh would expect exactly that much
prefill saved. A result is **exact** when it equals vLLM's, **over** when
kvmesh promises more (a router sends the request where the cache is not),
**under** when it promises less (a hit is missed). With a hash unit finer
than the block (Mamba ``align`` with ``hash_block_size`` 16 under 64-token
blocks), vLLM may reuse a prefix that ends inside a block; kvmesh then says
so in ``InstanceMatch.tokens`` (already within the last token), which is
its answer.

Lockstep: the engine announces a request only after publishing its pending
events, and schedules it only after ``{"go": true}``, so what the index
holds when ``Match`` runs is exactly what the engine's cache held when vLLM
looked it up. Several engines (``multi``) take turns, each its own instance.

Every run is seeded and deterministic on the engine side; what the index
answers is the figure under test.

**Engine processes.** Each engine is forked from a zygote
(``lab/engines/zygote.py``): one process per engine interpreter and program,
started with the first engine and shared by every run of the process (its
threads included), that has imported the engine program once. A child
forked from it is what ``python -m`` would start, without the 8 to 15 s of
importing vLLM or SGLang each time; it dies with the zygote, and the zygote
with this process. ``KVMESH_CONFORMANCE_ZYGOTE=0`` starts every engine as a
process of its own instead (:data:`ZYGOTE_ENV`).

Nothing here is vLLM's but the default: an :class:`EngineKind` names another
engine program speaking the same protocol, its interpreter and its scenarios
(``lab/conformance_sglang.py``: SGLang's radix cache).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from indexer import convert
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.blockkeys import block_keys
from lab.children import ChildProcess, Spawn, python_module, stop_all
from lab.engines.zygote import Zygote
from router_client.follower import IndexFollower

ROOT = Path(__file__).resolve().parents[1]

#: Environment variable naming the vLLM virtualenv's interpreter.
VLLM_PYTHON_ENV = "KVMESH_VLLM_PYTHON"
#: The vLLM virtualenv ``make setup`` creates.
LOCAL_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

#: Seconds an engine gets to print READY: importing vLLM and torch takes 5 to
#: 15 s, much longer on a 2-core machine that runs other tests meanwhile.
ENGINE_START_TIMEOUT_S = 300.0
#: Seconds an engine gets for one announcement after ``go`` (a step takes
#: milliseconds; the margin is for a loaded machine).
ENGINE_LINE_TIMEOUT_S = 300.0
#: Seconds an indexer gets to apply one batch, and to register an engine once
#: its socket connects. A batch takes milliseconds; generous for a loaded
#: machine shared with other test runs.
APPLY_TIMEOUT_S = 120.0
#: After every instance is registered: time for the SUB sockets' subscriptions
#: to reach the engines' PUB sockets, which drop what they send before
#: (ZMQ's slow joiner). The first batch is published only after the first
#: ``go``, so this wait happens once per run.
SUBSCRIBE_SETTLE_S = 0.5
#: Environment variable: ``0`` starts every engine with its interpreter
#: (``python -m``) instead of forking it from a zygote that imported it once.
ZYGOTE_ENV = "KVMESH_CONFORMANCE_ZYGOTE"
#: Mismatches kept per result for debugging.
EXAMPLES = 5
#: Default requests per scenario.
DEFAULT_REQUESTS = 2000


class EngineMissing(RuntimeError):
    """An engine's virtualenv (the interpreter its engine program runs with) is not there."""


class VllmMissing(EngineMissing):
    """The vLLM virtualenv the engines run in is not there."""


def vllm_python() -> Path:
    """The interpreter of the vLLM virtualenv: ``$KVMESH_VLLM_PYTHON``, else
    ``.venv-vllm`` (``make setup``).

    Raises :class:`VllmMissing` saying how to make it.
    """
    env = os.environ.get(VLLM_PYTHON_ENV)
    candidates = [Path(env)] if env else [LOCAL_VLLM_PYTHON]
    for path in candidates:
        if path.exists():
            return path
    raise VllmMissing(
        "no vLLM interpreter at " + " or ".join(str(p) for p in candidates) + "; run `make setup` "
        f"(it creates .venv-vllm with vLLM 0.33.0) or set {VLLM_PYTHON_ENV}"
    )


# -- what is run -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spec:
    """A scenario as this side runs it: the indexer's block size, engines, key modes."""

    scenario: str
    #: Tokens per block the indexer keys the model with (the engine's
    #: attention block size, which vLLM's events carry).
    block_size: int
    engines: int = 1
    #: The subscribers' ``keys`` modes measured, each its own row.
    keys: tuple[str, ...] = ("tokens",)
    what: str = ""
    #: Tokens per block the indexer keys with, when not the engine's block:
    #: vLLM's hash unit (``hash_block_size``), the granularity its events
    #: and its hits have (docs/engines.md, "Partial-block entries").
    index_block_size: int = 0
    #: The engine program's name for the scenario (``--scenario``), when it is
    #: not ``scenario`` (the row and model name, unique across engines).
    engine_scenario: str = ""

    @property
    def index_block(self) -> int:
        return self.index_block_size or self.block_size


SPECS: dict[str, Spec] = {
    s.scenario: s
    for s in (
        Spec(
            "full",
            16,
            keys=("tokens", "engine_hashes"),
            what="full attention, trace-shaped multi-turn conversations, resets",
        ),
        Spec("fanout", 16, what="n=3 parallel samples: one hash in several physical blocks"),
        Spec("swa", 16, what="full attention + sliding window 128: two KV-cache groups"),
        Spec(
            "mamba",
            64,
            what="full attention + Mamba2 (align), 64-token blocks, 16-token hashes",
        ),
        Spec("mamba64", 64, what="full attention + Mamba2 (align), 64-token blocks and hashes"),
        Spec("lora", 16, what="base model and two LoRA adapters on the same prompts"),
        Spec("salt", 16, what="two tenants' cache_salt on a shared system prompt"),
        Spec("mm", 16, what="4 images: identical placeholder tokens, different identifiers"),
        Spec("multi", 16, engines=3, what="3 engine instances sharing the trace"),
    )
}

#: Every scenario, in the order the table prints them.
SCENARIOS = tuple(SPECS)
BACKENDS = ("memory", "redis", "follower", "redis_follower")


@dataclass(frozen=True, slots=True)
class EngineKind:
    """An engine the harness runs: its program, its interpreter, its scenarios.

    The harness itself is engine-agnostic: an engine program speaks the
    lockstep protocol (``lab/engines/vllm_engine.py``'s docstring) whatever
    cache it drives.
    """

    #: For messages and reports ("vLLM", "SGLang").
    name: str
    #: The engine program, run as ``python -m module``.
    module: str
    #: Worker ids are ``<worker_prefix>-<index>``.
    worker_prefix: str
    specs: Mapping[str, Spec]
    #: The engine's interpreter; raises :class:`EngineMissing` saying how to get it.
    python: Callable[[], Path]
    #: Set in the engine's environment unless already set.
    env: Mapping[str, str] = field(default_factory=dict)


#: vLLM 0.33, the engine of :data:`SPECS`.
VLLM = EngineKind(
    "vLLM",
    "lab.engines.vllm_engine",
    "vllm",
    SPECS,
    vllm_python,
    {"VLLM_LOGGING_LEVEL": "WARNING"},
)


def row_name(scenario: str, keys: str) -> str:
    """The result row of a scenario measured with a subscriber ``keys`` mode."""
    return scenario if keys == "tokens" else f"{scenario}_{keys}"


# -- the comparison ------------------------------------------------------------------


def predicted_tokens(depth: int, block_size: int, n_tokens: int, tokens: int = 0) -> int:
    """The tokens a worker reuses by kvmesh's answer, counted the way vLLM counts its hit.

    ``depth`` blocks of ``block_size`` tokens, but never past the last whole
    block before the request's last token (vLLM recomputes the last token, and
    a hit ends on a block boundary; see the module docstring). ``tokens``
    (``InstanceMatch.tokens``, a hit that ends inside a block) is the answer
    itself, already within the request's last token.
    """
    if n_tokens <= 0:
        return 0
    if tokens > 0:
        return min(tokens, n_tokens - 1)
    if depth <= 0:
        return 0
    return min(depth * block_size, (n_tokens - 1) // block_size * block_size)


def classify(predicted: int, truth: int) -> str:
    """``exact``, ``over`` (kvmesh promises more than vLLM reuses) or ``under``."""
    if predicted == truth:
        return "exact"
    return "over" if predicted > truth else "under"


@dataclass(frozen=True, slots=True)
class Announcement:
    """A request the engine is about to admit, with vLLM's own lookup result."""

    req: str
    tokens: tuple[int, ...]
    lora_name: str
    cache_salt: str
    #: (identifier, offset, length) of each multimodal item.
    mm: tuple[tuple[str, int, int], ...]
    #: The engine's block hashes at its attention block size, as its events carry them.
    hashes: tuple[int, ...]
    #: Sequence of the last batch the engine published before the lookup (-1: none).
    seq: int
    #: ``num_computed_tokens`` from ``KVCacheManager.get_computed_blocks``.
    truth: int
    resumed: bool = False
    retry: bool = False

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Announcement:
        return cls(
            req=str(obj["req"]),
            tokens=tuple(int(t) for t in obj["tokens"]),
            lora_name=str(obj.get("lora_name") or ""),
            cache_salt=str(obj.get("cache_salt") or ""),
            mm=tuple((str(m[0]), int(m[1]), int(m[2])) for m in obj.get("mm") or ()),
            hashes=tuple(int(h) for h in obj.get("hashes") or ()),
            seq=int(obj["seq"]),
            truth=int(obj["truth"]),
            resumed=bool(obj.get("resumed")),
            retry=bool(obj.get("retry")),
        )


def query_for(announcement: Announcement, *, model: str, keys: str = "tokens") -> pb.MatchRequest:
    """The Match a router would send for this request: the one place a query is built.

    ``keys`` is the subscriber mode: ``tokens`` sends the prompt's token ids
    (kvmesh keys them), ``engine_hashes`` the engine's own block hashes as
    block keys (which already cover everything vLLM hashed). With token ids,
    the request's ``cache_salt`` and multimodal items (identifier, offset,
    length) go in ``MatchRequest.cache_salt`` and ``media`` when the stubs
    have those fields: without them kvmesh cannot tell two tenants, or two
    images with the same placeholder tokens, apart.
    """
    query = pb.MatchRequest(model=model, lora_name=announcement.lora_name)
    if keys == "engine_hashes":
        query.block_keys.extend(announcement.hashes)
        return query
    query.token_ids.extend(announcement.tokens)
    fields = pb.MatchRequest.DESCRIPTOR.fields_by_name
    extra: Any = query  # the extra-key fields are newer than some stubs
    if announcement.cache_salt and "cache_salt" in fields:
        extra.cache_salt = announcement.cache_salt
    if announcement.mm and "media" in fields:
        for identifier, offset, length in announcement.mm:
            extra.media.add(identifier=identifier, offset=offset, length=length)
    return query


@dataclass(frozen=True, slots=True)
class Observation:
    """One compared lookup: what vLLM reused and what kvmesh answered."""

    req: str
    n_tokens: int
    truth: int
    depth: int
    block_size: int
    resumed: bool
    retry: bool
    lora_name: str
    cache_salt: str
    mm: tuple[str, ...]
    #: ``InstanceMatch.tokens``: the hit when it ends inside block ``depth`` (0: whole blocks).
    tokens: int = 0

    def predicted(self, skew_blocks: int = 0) -> int:
        """kvmesh's answer in tokens; ``skew_blocks`` deliberately adds blocks to it."""
        tokens = self.tokens + skew_blocks * self.block_size if self.tokens else 0
        return predicted_tokens(self.depth + skew_blocks, self.block_size, self.n_tokens, tokens)


@dataclass(slots=True)
class Result:
    """One row of the conformance table: a scenario (and key mode) on one backend."""

    row: str
    backend: str
    requests: int = 0
    #: Requests where vLLM or kvmesh saw a hit (the rest agree trivially on 0).
    hits: int = 0
    exact: int = 0
    over: int = 0
    under: int = 0
    #: Batches the indexer rejected (the subscriber then reset the instance).
    rejected_batches: int = 0
    truth_tokens: int = 0
    predicted_tokens: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def exact_fraction(self) -> float:
        return self.exact / self.requests if self.requests else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "row": self.row,
            "backend": self.backend,
            "requests": self.requests,
            "hits": self.hits,
            "exact": self.exact,
            "over": self.over,
            "under": self.under,
            "exact_fraction": self.exact_fraction,
            "rejected_batches": self.rejected_batches,
            "truth_tokens": self.truth_tokens,
            "predicted_tokens": self.predicted_tokens,
            "examples": self.examples,
        }


def summarize(
    row: str,
    backend: str,
    observations: Sequence[Observation],
    *,
    skew_blocks: int = 0,
    rejected_batches: int = 0,
) -> Result:
    """Classify every observation; keep the first :data:`EXAMPLES` mismatches."""
    out = Result(row, backend, rejected_batches=rejected_batches)
    for ob in observations:
        predicted = ob.predicted(skew_blocks)
        verdict = classify(predicted, ob.truth)
        out.requests += 1
        out.hits += int(predicted > 0 or ob.truth > 0)
        out.truth_tokens += ob.truth
        out.predicted_tokens += predicted
        setattr(out, verdict, getattr(out, verdict) + 1)
        if verdict != "exact" and len(out.examples) < EXAMPLES:
            out.examples.append(
                {
                    "req": ob.req,
                    "verdict": verdict,
                    "tokens": ob.n_tokens,
                    "engine": ob.truth,
                    "kvmesh": predicted,
                    "depth": ob.depth,
                    "resumed": ob.resumed,
                    "retry": ob.retry,
                    "lora_name": ob.lora_name,
                    "cache_salt": ob.cache_salt,
                    "mm": list(ob.mm),
                }
            )
    return out


# -- processes ---------------------------------------------------------------------


@dataclass(slots=True)
class Engine:
    """One engine process and what this side knows of it."""

    index: int
    child: ChildProcess
    endpoint: str
    replay_endpoint: str
    shape: dict[str, Any] = field(default_factory=dict)
    current: Announcement | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    prefix: str = "vllm"

    @property
    def worker(self) -> str:
        return f"{self.prefix}-{self.index}"

    def read(self) -> None:
        """The engine's next line: an announcement, or its final report."""
        obj = json.loads(self.child.read_line(ENGINE_LINE_TIMEOUT_S))
        if obj.get("done"):
            self.done = True
            self.current = None
            self.stats = dict(obj.get("stats") or {})
        else:
            self.current = Announcement.from_json(obj)

    def go(self) -> None:
        self.child.send_line('{"go": true}')


@dataclass(slots=True)
class Watch:
    """What this side last saw of one instance in one indexer."""

    incarnation: str
    #: Highest announced sequence known to be processed.
    confirmed: int = -1
    rejected: int = 0


@dataclass(slots=True)
class Indexer:
    """One indexer process (one backend) and its stub."""

    backend: str
    child: ChildProcess
    stub: Any = None
    channel: Any = None
    watches: dict[tuple[str, str], Watch] = field(default_factory=dict)
    port: int = 0


def model_for(scenario: str, keys: str) -> str:
    """The model (namespace) an engine's instance is registered under, per key mode."""
    return f"conformance-{scenario}" + ("" if keys == "tokens" else f"-{keys}")


def worker_for(engine: Engine, keys: str) -> str:
    return engine.worker + ("" if keys == "tokens" else f"-{keys}")


def _instance(stub: Any, model: str, worker: str) -> Any:
    for info in stub.ListInstances(pb.ListInstancesRequest(model=model), timeout=30).instances:
        if info.instance.worker_id == worker:
            return info
    return None


def wait_registered(stub: Any, model: str, worker: str, timeout_s: float = APPLY_TIMEOUT_S) -> str:
    """Wait until the indexer's subscriber registered the instance (its socket connected);
    return the instance's incarnation."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = _instance(stub, model, worker)
        if info is not None:
            return str(info.incarnation)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{worker} ({model}) not registered after {timeout_s:.0f} s")
        time.sleep(0.05)


def wait_processed(
    stub: Any, model: str, worker: str, seq: int, watch: Watch, timeout_s: float = APPLY_TIMEOUT_S
) -> None:
    """Wait until the indexer processed the instance's batch ``seq``.

    Processed means applied (the instance's applied sequence reached it) or
    rejected: a rejected batch is lost for good, and the subscriber's policy
    (``on_unrecoverable_gap: reset``) registers the instance again with a new
    incarnation, which empties it; a new incarnation with nothing applied is
    that. One batch at a time is in flight per instance (lockstep), so either
    sign is about this batch.
    """
    if seq <= watch.confirmed:
        return
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while True:
        info = _instance(stub, model, worker)
        if info is not None:
            if info.has_applied_sequence and info.applied_sequence >= seq:
                watch.incarnation = str(info.incarnation)
                watch.confirmed = seq
                return
            if info.incarnation != watch.incarnation and not info.has_applied_sequence:
                watch.incarnation = str(info.incarnation)
                watch.confirmed = seq
                watch.rejected += 1
                return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{worker} ({model}): batch {seq} not processed after {timeout_s:.0f} s "
                f"(last seen: {info})"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def depth_of(stub: Any, query: pb.MatchRequest, worker: str) -> int:
    """The depth Match gives ``worker`` (0 when it is not among the holders)."""
    return hit_of(stub, query, worker)[0]


def hit_of(stub: Any, query: pb.MatchRequest, worker: str) -> tuple[int, int]:
    """``(depth, tokens)`` Match gives ``worker`` ((0, 0) when it is not among the
    holders; tokens 0 when the hit is depth whole blocks)."""
    for m in stub.Match(query, timeout=30).matches:
        if m.instance.worker_id == worker:
            return int(m.depth), int(getattr(m, "tokens", 0))
    return 0, 0


#: Backends that are a router's follower, and the backend whose indexer each
#: follows: the memory one's own index, or the copy of the shared index the
#: Redis one keeps for its followers (indexer/redis/watchfeed.py).
FOLLOWS = {"follower": "memory", "redis_follower": "redis"}


class FollowerStub:
    """The ``follower`` and ``redis_follower`` backends: a router's follower
    (router_client/follower.py) of the run's memory or Redis indexer, in a
    thread with its own event loop, behind the
    two calls the harness makes. Match keys the query as a router does
    (kvmesh.blockkeys, the indexer's block size) and asks the follower; what
    the follower declines (a hybrid-attention model: its hits are cut by group
    presence only the ingesting replica holds) goes to the memory indexer, as
    ``IndexerClient(follower=...)`` does; those are counted in ``declined``.
    """

    def __init__(self, target: str, remote: Any, block_size: int) -> None:
        self._remote = remote
        self._block = block_size
        self.declined = 0
        #: Matches the follower answered itself.
        self.answered = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="conformance-follower", daemon=True
        )
        self._thread.start()

        async def make() -> IndexFollower:
            return await IndexFollower(target).start()  # its channel needs the loop

        self.follower = self._call(make())
        if not self._call(self.follower.wait_synced(60)):
            raise RuntimeError(f"the follower did not sync with the indexer at {target} in 60 s")

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(60)

    def ListInstances(self, req: pb.ListInstancesRequest, timeout: float = 0) -> Any:
        states = self._call(self.follower.index.list_instances(req.model))
        return pb.ListInstancesResponse(instances=[convert.state_to_pb(s) for s in states])

    def Match(self, req: pb.MatchRequest, timeout: float = 0) -> pb.MatchResponse:
        if req.block_keys:
            keys = list(req.block_keys)
        else:
            n = len(req.token_ids) // self._block
            keys = block_keys(
                list(req.token_ids[: n * self._block]),
                self._block,
                req.model,
                req.lora_name,
                cache_salt=req.cache_salt,
                media=[(m.identifier, m.offset, m.length) for m in req.media],
            )

        async def ask() -> Any:
            return self.follower.match(req.model, req.lora_name, keys)

        out = self._call(ask()) if keys else None
        if out is None and keys:
            self.declined += 1
            resp: pb.MatchResponse = self._remote.Match(req, timeout=timeout or 30)
            return resp
        if keys:
            self.answered += 1
        resp = pb.MatchResponse()
        for name, m in (out.matches if out is not None else {}).items():
            worker, _, rank = name.partition("/dp")
            resp.matches.add(
                instance=pb.InstanceRef(worker_id=worker, dp_rank=int(rank or 0)),
                depth=m.depth,
                tokens=m.tokens,
            )
        return resp

    def close(self) -> None:
        try:
            self._call(self.follower.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def _indexer_config(spec: Spec, engines: Sequence[Engine], redis_prefix: str) -> dict[str, Any]:
    endpoints = [
        {
            "worker_id": worker_for(e, keys),
            "model": model_for(spec.scenario, keys),
            "endpoint": e.endpoint,
            "replay_endpoint": e.replay_endpoint,
            "keys": keys,
        }
        for e in engines
        for keys in spec.keys
    ]
    return {
        "block_size": spec.index_block,
        "engine_events": {"endpoints": endpoints, "replay_timeout_s": 10.0},
        "redis": {"prefix": redis_prefix},
    }


@dataclass(slots=True)
class RunResult:
    """Everything one scenario run measured."""

    spec: Spec
    requests: int
    observations: dict[tuple[str, str], list[Observation]]
    rejected: dict[tuple[str, str], int]
    engines: list[dict[str, Any]]
    seconds: float
    #: Per follower backend, (Matches it answered in process, Matches it
    #: declined to its indexer): a follower that answers nothing itself
    #: would pass the comparison on its indexer's answers.
    follower_answers: dict[str, tuple[int, int]] = field(default_factory=dict)

    def results(self, skew_blocks: int = 0) -> list[Result]:
        """One :class:`Result` per (row, backend), in table order."""
        return [
            summarize(
                row,
                backend,
                obs,
                skew_blocks=skew_blocks,
                rejected_batches=self.rejected.get((row, backend), 0),
            )
            for (row, backend), obs in self.observations.items()
        ]


#: The process's zygotes by (interpreter, engine program); see the module docstring.
_ZYGOTES: dict[tuple[str, str], tuple[Zygote, Path]] = {}
_ZYGOTES_LOCK = threading.Lock()


def engine_spawn(interpreter: Path, kind: EngineKind, env: Mapping[str, str]) -> Spawn | None:
    """What starts ``kind``'s engines with ``interpreter``: the process's zygote of
    them (started, with ``env``, by the first engine it forks), or None when
    :data:`ZYGOTE_ENV` is ``0``."""
    if os.environ.get(ZYGOTE_ENV, "1") == "0":
        return None
    key = (str(interpreter), kind.module)
    with _ZYGOTES_LOCK:
        entry = _ZYGOTES.get(key)
        if entry is None or entry[0].ended():
            if entry is not None:
                shutil.rmtree(entry[1], ignore_errors=True)
            if not _ZYGOTES:
                atexit.register(close_zygotes)
            logs = Path(tempfile.mkdtemp(prefix="kvz-"))
            zygote = Zygote(
                interpreter,
                kind.module,
                env=env,
                log_path=logs / "zygote.log",
                start_timeout_s=ENGINE_START_TIMEOUT_S,
            )
            entry = _ZYGOTES[key] = (zygote, logs)
    return entry[0].spawn


def close_zygotes(*, idle_only: bool = False) -> None:
    """Stop the process's zygotes (``idle_only``: those with no engine running);
    the next engine starts a new one."""
    with _ZYGOTES_LOCK:
        for key, (zygote, logs) in list(_ZYGOTES.items()):
            if idle_only and not zygote.idle():
                continue
            zygote.close()
            shutil.rmtree(logs, ignore_errors=True)
            del _ZYGOTES[key]


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    # Short: ipc:// paths must fit a Unix socket address (about 100 bytes).
    path = Path(tempfile.mkdtemp(prefix="kvc-", dir="/tmp" if os.path.isdir("/tmp") else None))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_scenario(
    scenario: str,
    *,
    requests: int = DEFAULT_REQUESTS,
    backends: Sequence[str] = BACKENDS,
    redis_url: str = "",
    seed: int = 1,
    python: Path | None = None,
    log_dir: Path | None = None,
    block_size: int = 0,
    engine: EngineKind | None = None,
) -> RunResult:
    """Run one scenario's engine(s) against an indexer per backend; every lookup compared.

    ``redis_url`` is required for the redis backend (a private ``redis-server``,
    e.g. :class:`lab.redisproc.RedisProcess`; keys go under a fresh prefix).
    ``log_dir`` keeps the children's logs (default: removed with the run).
    ``block_size`` overrides the scenario's (the engine's attention block and
    the indexer's block size alike; 0: the scenario's). ``engine``: whose
    scenario it is (default :data:`VLLM`).
    """
    kind = engine or VLLM
    spec = kind.specs[scenario]
    if block_size:
        spec = dataclasses.replace(spec, block_size=block_size)
    if "redis" in backends and not redis_url:
        raise ValueError("the redis backend needs redis_url")
    interpreter = python or kind.python()
    started = time.monotonic()
    with _workdir() as work:
        logs = log_dir or work
        logs.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        for name, value in kind.env.items():
            env.setdefault(name, value)
        spawn = engine_spawn(interpreter, kind, env)
        engines: list[Engine] = []
        indexers: list[Indexer] = []
        children: list[ChildProcess] = []
        try:
            per_engine = max(1, requests // spec.engines)
            for i in range(spec.engines):
                ep, rep = f"ipc://{work}/e{i}.pub", f"ipc://{work}/e{i}.replay"
                argv = [str(interpreter), "-m", kind.module]
                argv += ["--scenario", spec.engine_scenario or scenario]
                argv += ["--requests", str(per_engine)]
                argv += ["--seed", str(seed), "--block-size", str(spec.block_size)]
                argv += ["--endpoint", ep, "--replay-endpoint", rep]
                argv += ["--instance", str(i), "--instances", str(spec.engines)]
                child = ChildProcess(
                    argv,
                    name=f"{kind.name} engine {scenario}/{i}",
                    env=env,
                    log_path=logs / f"{scenario}-engine{i}.log",
                    pipes=True,
                    die_with_parent=True,
                    spawn=spawn,
                )
                engines.append(Engine(i, child, ep, rep, prefix=kind.worker_prefix))
                children.append(child.start())
            prefix = f"kvc{uuid.uuid4().hex[:8]}"
            for backend in backends:
                if backend in FOLLOWS:
                    continue  # follows the memory or Redis indexer (below)
                overrides = _indexer_config(spec, engines, prefix)
                argv = python_module("lab.bench.indexer_common", "--serve", backend)
                if backend == "redis":
                    argv += ["--redis-url", redis_url]
                argv += ["--server-config", json.dumps(overrides)]
                child = ChildProcess(
                    argv,
                    name=f"indexer {backend} ({scenario})",
                    log_path=logs / f"{scenario}-indexer-{backend}.log",
                    pipes=True,
                    die_with_parent=True,
                )
                indexers.append(Indexer(backend, child))
                children.append(child.start())
            for ix in indexers:
                port = int(ix.child.wait_line(ENGINE_START_TIMEOUT_S))
                ix.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
                ix.stub = pb_grpc.IndexerServiceStub(ix.channel)
                ix.port = port
            for name, followed in FOLLOWS.items():
                if name not in backends:
                    continue
                leader = next((ix for ix in indexers if ix.backend == followed), None)
                if leader is None:
                    raise ValueError(f"the {name} backend follows the {followed} one: ask both")
                follower = Indexer(name, leader.child)
                follower.stub = FollowerStub(
                    f"127.0.0.1:{leader.port}", leader.stub, spec.index_block
                )
                indexers.append(follower)
            for e in engines:
                e.shape = json.loads(e.child.wait_line(ENGINE_START_TIMEOUT_S))
                if int(e.shape["block_size"]) != spec.block_size:
                    raise RuntimeError(f"engine block size {e.shape['block_size']} != {spec}")
            for ix in indexers:
                for e in engines:
                    for keys in spec.keys:
                        model, worker = model_for(scenario, keys), worker_for(e, keys)
                        ix.watches[(model, worker)] = Watch(wait_registered(ix.stub, model, worker))
            time.sleep(SUBSCRIBE_SETTLE_S)
            observations = _drive(spec, engines, indexers)
            rejected = {
                (row_name(scenario, keys), ix.backend): sum(
                    ix.watches[(model_for(scenario, keys), worker_for(e, keys))].rejected
                    for e in engines
                )
                for ix in indexers
                for keys in spec.keys
            }
            stats = [{"shape": e.shape, **e.stats} for e in engines]
            answers = {
                ix.backend: (ix.stub.answered, ix.stub.declined)
                for ix in indexers
                if isinstance(ix.stub, FollowerStub)
            }
        finally:
            for ix in indexers:
                if isinstance(ix.stub, FollowerStub):
                    ix.stub.close()
                if ix.channel is not None:
                    ix.channel.close()
            stop_all(children)
    return RunResult(
        spec,
        requests,
        observations,
        rejected,
        stats,
        time.monotonic() - started,
        answers,
    )


def _drive(
    spec: Spec, engines: Sequence[Engine], indexers: Sequence[Indexer]
) -> dict[tuple[str, str], list[Observation]]:
    """The lockstep loop: engines take turns; each announcement is checked on every indexer.

    An engine schedules its request as soon as it has its ``go``, while the
    next engine's announcement is checked: engines are separate instances,
    and each one's next lookup waits for its own turn.
    """
    out: dict[tuple[str, str], list[Observation]] = {
        (row_name(spec.scenario, keys), ix.backend): [] for keys in spec.keys for ix in indexers
    }
    for e in engines:
        e.read()
    while True:
        live = [e for e in engines if not e.done]
        if not live:
            return out
        for e in live:
            if e.current is None:
                e.read()
                if e.done:
                    continue
            ann = e.current
            assert ann is not None
            for keys in spec.keys:
                model, worker = model_for(spec.scenario, keys), worker_for(e, keys)
                for ix in indexers:
                    wait_processed(ix.stub, model, worker, ann.seq, ix.watches[(model, worker)])
                query = query_for(ann, model=model, keys=keys)
                for ix in indexers:
                    depth, tokens = hit_of(ix.stub, query, worker)
                    out[(row_name(spec.scenario, keys), ix.backend)].append(
                        Observation(
                            ann.req,
                            len(ann.tokens),
                            ann.truth,
                            depth,
                            spec.index_block,
                            ann.resumed,
                            ann.retry,
                            ann.lora_name,
                            ann.cache_salt,
                            tuple(m[0] for m in ann.mm),
                            tokens,
                        )
                    )
            e.current = None
            e.go()


class ScenarioRuns:
    """Scenario runs on ``jobs`` threads, started in the order given, each awaited by name.

    Runs overlap well on two cores: most of a run's wall time is the harness
    waiting on a child (the lockstep round trip through ZMQ, an indexer and
    Match), so a second run proceeds while the first one waits. The engines'
    lockstep is per run; concurrent runs share nothing but the Redis server
    (each run uses a key prefix of its own) and the engines' zygote, which
    forks their engines one request at a time. :meth:`close` stops the
    zygotes no other run is using.
    """

    def __init__(self, names: Sequence[str], *, jobs: int = 2, **kwargs: Any) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="conformance")
        self._futures: dict[str, Future[RunResult]] = {
            name: self._pool.submit(run_scenario, name, **kwargs) for name in names
        }

    def get(self, name: str) -> RunResult:
        """The run of scenario ``name`` (waits for it; raises what the run raised)."""
        return self._futures[name].result()

    def close(self) -> None:
        """Cancel runs not started yet, wait for the running ones, stop idle zygotes."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        close_zygotes(idle_only=True)
