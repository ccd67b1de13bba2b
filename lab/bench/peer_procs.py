"""The processes of ``kvmesh bench peer``: vLLM publishers, both indexers, their clients.

- :class:`PublisherFleet`: a few processes of ``lab/engines/vllm_publishers.py``
  in the vLLM virtualenv (:func:`lab.conformance.vllm_python`), together one
  real vLLM ``ZmqEventPublisher`` per instance and round.
- :class:`KvmeshSide`: ``kvmesh indexer serve`` as a child process with a
  config file of its own (its ZMQ subscribers to every publisher of its
  rounds, keys from tokens), and its gRPC clients.
- :class:`DynamoSide`: NVIDIA Dynamo's standalone KV indexer (``python -m
  dynamo.indexer`` from ``ai-dynamo-runtime``) in a virtualenv of its own
  (:func:`dynamo_python`, installed on first use), the publishers registered
  through its ``/register``, and its HTTP clients.

Both sides answer the same calls (:class:`Side`), each with its own wire;
the bench (:mod:`lab.bench.peer`) measures and checks them alike. Dynamo's
indexer binds 0.0.0.0, so a run with it takes place in a private network
namespace whose only interface is loopback (:func:`run_in_private_netns`).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.blockkeys import block_keys
from lab.children import ChildProcess, ProcTimes, python_module, stop_all
from lab.conformance import vllm_python
from lab.engines.vllm_publishers import endpoints
from lab.redisproc import free_port

ROOT = Path(__file__).resolve().parents[2]

#: The peer's package, pinned: the figures are of this release.
DYNAMO_REQUIREMENT = "ai-dynamo-runtime==1.6.1"
#: Environment variable naming another interpreter that has it.
DYNAMO_PYTHON_ENV = "KVMESH_DYNAMO_PYTHON"
#: The virtualenv ``make peer-venvs`` (and the first run) creates.
DYNAMO_VENV = ROOT / ".venv-dynamo"
_DYNAMO_STAMP = DYNAMO_VENV / ".installed"

#: Set in the environment of a run inside its private network namespace.
NETNS_ENV = "KVMESH_PEER_NETNS"

#: Seconds a publisher process gets to import vLLM and encode its batches, and
#: an indexer to start: generous for a loaded 2-core machine.
START_TIMEOUT_S = 300.0
#: Seconds one command to the publishers (open, warm, close) may take.
COMMAND_TIMEOUT_S = 120.0


# -- the Dynamo virtualenv and the private namespace ---------------------------------


def dynamo_install_commands(venv: Path = DYNAMO_VENV) -> list[list[str]]:
    """What creates the Dynamo virtualenv (``make peer-venvs`` runs the same)."""
    return [
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "pip"), "install", "--quiet", DYNAMO_REQUIREMENT],
    ]


def dynamo_python(install: bool = True) -> Path:
    """The interpreter that has Dynamo: ``$KVMESH_DYNAMO_PYTHON``, else ``.venv-dynamo``.

    ``install``: create ``.venv-dynamo`` when it is missing, saying what runs
    (about 30 s and 300 MB); otherwise raise ``RuntimeError`` saying how.
    """
    env = os.environ.get(DYNAMO_PYTHON_ENV)
    if env:
        return Path(env)
    python = DYNAMO_VENV / "bin" / "python"
    if _DYNAMO_STAMP.exists() and python.exists():
        return python
    commands = dynamo_install_commands()
    shown = "\n".join("  " + " ".join(c) for c in commands)
    if not install:
        raise RuntimeError(
            f"no Dynamo virtualenv at {DYNAMO_VENV}; run `make peer-venvs`, or:\n{shown}\n"
            f"or set {DYNAMO_PYTHON_ENV}"
        )
    print(f"kvmesh bench peer: installing {DYNAMO_REQUIREMENT} into {DYNAMO_VENV}:\n{shown}")
    t0 = time.perf_counter()
    for c in commands:
        subprocess.run(c, check=True)
    # A virtualenv that ignores itself (what `python -m venv` writes from 3.13 on).
    (DYNAMO_VENV / ".gitignore").write_text("*\n", encoding="utf-8")
    _DYNAMO_STAMP.touch()
    print(f"kvmesh bench peer: installed in {time.perf_counter() - t0:.0f} s")
    return python


def in_private_netns() -> bool:
    """Whether this process is the run inside :func:`run_in_private_netns`."""
    return os.environ.get(NETNS_ENV) == "1"


def run_in_private_netns(module: str, argv: Sequence[str]) -> int:
    """Run ``python -m module argv`` in a new network namespace with only loopback up.

    ``unshare -rn`` (a user namespace maps this user to root in it, so no
    privilege is needed); every server of the run then listens on that
    namespace's loopback only, whatever address it binds.
    """
    unshare, ip = shutil.which("unshare"), _find_ip()
    if unshare is None or ip is None:
        raise RuntimeError(
            "the peer runs in a private network namespace, which needs `unshare` and `ip` "
            "(util-linux, iproute2); run with --peer none without them"
        )
    script = f'{ip} link set lo up && exec "$@"'
    cmd = [unshare, "-rn", "sh", "-c", script, "sh", sys.executable, "-m", module, *argv]
    proc = subprocess.Popen(cmd, env={**os.environ, NETNS_ENV: "1"})
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            continue  # the run inside got the same Ctrl-C and stops its children itself


def _find_ip() -> str | None:
    found = shutil.which("ip")
    if found:
        return found
    for path in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip"):
        if os.access(path, os.X_OK):
            return path
    return None


# -- the publishers ------------------------------------------------------------------


class PublisherFleet:
    """``procs`` publisher processes sharing ``instances`` instances (context manager).

    The plan file names every instance's batches; each process encodes its
    share at start. :meth:`command` runs ``open``/``warm``/``close`` of a round
    on every process and waits; :meth:`go` starts a round's stream and
    returns at once, :meth:`wait_sent` waits for its end.
    """

    def __init__(
        self, plan_path: Path, instances: int, procs: int, sock_dir: Path, log_dir: Path
    ) -> None:
        python = vllm_python()
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.instances = instances
        self.sock_dir = str(sock_dir)
        self.procs = [
            ChildProcess(
                [
                    str(python),
                    "-m",
                    "lab.engines.vllm_publishers",
                    *("--plan", str(plan_path), "--proc", str(k), "--procs", str(procs)),
                    *("--dir", self.sock_dir),
                ],
                name=f"vllm publishers {k}",
                env=env,
                log_path=log_dir / f"publishers{k}.log",
                pipes=True,
                die_with_parent=True,
            )
            for k in range(procs)
        ]
        self.ready: list[dict[str, Any]] = []
        self._streaming: set[int] = set()

    def __enter__(self) -> PublisherFleet:
        try:
            for p in self.procs:
                p.start()
            self.ready = [json.loads(p.wait_line(START_TIMEOUT_S)) for p in self.procs]
        except BaseException:
            stop_all(self.procs)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_all(self.procs)

    def cpu_seconds(self) -> float | None:
        """CPU seconds the publisher processes have used so far."""
        used = [p.cpu_seconds() for p in self.procs]
        return None if any(u is None for u in used) else sum(u or 0.0 for u in used)

    def endpoints(self, r: int) -> list[tuple[str, str]]:
        """PUB and replay endpoints of every instance in round ``r``, by instance."""
        return [endpoints(self.sock_dir, r, i) for i in range(self.instances)]

    def command(self, cmd: str, r: int, timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        """Run ``cmd r`` on every process and wait for all of them (after any round
        still streaming: a run that failed mid-round closes it afterwards)."""
        for pending in sorted(self._streaming):
            self.wait_sent(pending, START_TIMEOUT_S)
        for p in self.procs:
            p.send_line(f"{cmd} {r}")
        self._wait(cmd, r, timeout_s)

    def go(self, r: int) -> None:
        """Have round ``r`` streamed (returns at once)."""
        for p in self.procs:
            p.send_line(f"go {r}")
        self._streaming.add(r)

    def wait_sent(self, r: int, timeout_s: float) -> None:
        """Wait until every process has sent all of round ``r``."""
        if r in self._streaming:
            self._wait("go", r, timeout_s)
            self._streaming.discard(r)

    def _wait(self, cmd: str, r: int, timeout_s: float) -> None:
        for p in self.procs:
            got = p.wait_line(timeout_s, word="OK")
            if got != f"{cmd} {r}":
                raise RuntimeError(f"{p.name} answered {got!r} to {cmd} {r}")


# -- the sides -----------------------------------------------------------------------


@dataclass(slots=True)
class Query:
    """One query of the bench: its tokens and what each side sends for it."""

    tokens: list[int]
    #: Dynamo's local hashes of the full blocks (``/query_by_hash``).
    dynamo_hashes: list[int] = field(default_factory=list)


#: An answer: instance index -> depth in blocks, for every instance holding block 0.
Answer = dict[int, int]


class Side(Protocol):
    """What the bench asks of one indexer (kvmesh or Dynamo), sync and async."""

    name: str

    def prepare(self, model: str, queries: Sequence[Query]) -> None:
        """Build this side's requests of ``queries`` against ``model`` (before any clock)."""

    def match_tokens(self, k: int) -> Answer:
        """Query ``k`` by token ids."""

    def match_keys(self, k: int) -> Answer:
        """Query ``k`` by block keys (Dynamo: its local hashes)."""

    def floor(self) -> None:
        """The call that does no work (kvmesh Ping, Dynamo /health)."""

    def holders(self, model: str, tokens: Sequence[int]) -> Answer:
        """Who holds a prefix of ``tokens`` in ``model`` (warm-up and sentinel checks)."""

    def applied(self) -> dict[str, float]:
        """The index's own counters: ``applied`` (kvmesh: batches; Dynamo: events),
        ``errors`` (kvmesh: batches answered with an error, which its subscriber
        retries; Dynamo: events applied with a status other than ok), and for
        kvmesh ``duplicate`` (batches it had applied already)."""

    def cpu_seconds(self) -> float | None:
        """CPU seconds of the indexer process so far."""

    def query_cpu_seconds(self) -> float | None:
        """CPU seconds so far of a replica that only answers (None: the side has none)."""

    def proc_times(self) -> ProcTimes | None:
        """The indexer process's CPU time (user, kernel) and page faults so far."""

    def rss_bytes(self) -> float | None:
        """Resident set size of the indexer process."""

    async def aopen(self) -> None:
        """Open the async clients (in the running loop)."""

    async def aclose(self) -> None:
        """Close them."""

    async def amatch_tokens(self, k: int, timeout_s: float) -> Answer:
        """:meth:`match_tokens`, async."""

    async def ahealth(self, timeout_s: float) -> None:
        """The health check a kubelet or a load balancer would make."""

    async def aholders(self, model: str, tokens: Sequence[int]) -> Answer:
        """:meth:`holders`, async."""


def worker_id(r: int, i: int) -> str:
    """kvmesh worker id of instance ``i`` in round ``r`` (unique across rounds)."""
    return f"r{r}-e{i:03d}"


def _index_of(worker: str) -> int:
    return int(worker.rpartition("-e")[2])


class KvmeshSide:
    """``kvmesh indexer serve`` subscribed to the publishers of ``rounds`` (context manager).

    ``config`` is the whole config file (written to ``work``); the server runs
    as ``python -m kvmesh.cli indexer serve --config FILE``.
    """

    def __init__(
        self,
        name: str,
        config: dict[str, Any],
        work: Path,
        block_size: int,
        query_replica: bool = False,
    ) -> None:
        self.name = name
        self.block_size = block_size
        self.port = free_port()
        self.config = {**config, "host": "127.0.0.1", "port": self.port}
        self.config_path = work / f"indexer-{name}.json"
        self.config_path.write_text(json.dumps(self.config, indent=2), encoding="utf-8")
        self.child = ChildProcess(
            python_module("kvmesh.cli", "indexer", "serve", "--config", str(self.config_path)),
            name=f"kvmesh indexer ({name})",
            log_path=work / f"indexer-{name}.log",
            die_with_parent=True,
        )
        self.target = f"127.0.0.1:{self.port}"
        #: With ``query_replica`` (a shared store only): a second replica over the
        #: same store that subscribes to no engine, as a fleet that keeps its
        #: ingest and its routers' calls on separate replicas runs; the probes
        #: during an ingest ask it. Its CPU is counted apart (query_cpu_seconds).
        self.query_child: ChildProcess | None = None
        self.query_target = self.target
        if query_replica:
            if config.get("backend") != "redis":
                raise ValueError("a query replica needs a shared store (redis or cluster)")
            qport = free_port()
            qconfig = {
                **self.config,
                "port": qport,
                "metrics_port": free_port(),
                "engine_events": {"endpoints": []},
            }
            qpath = work / f"indexer-{name}-query.json"
            qpath.write_text(json.dumps(qconfig, indent=2), encoding="utf-8")
            self.query_child = ChildProcess(
                python_module("kvmesh.cli", "indexer", "serve", "--config", str(qpath)),
                name=f"kvmesh indexer ({name}, query replica)",
                log_path=work / f"indexer-{name}-query.log",
                die_with_parent=True,
            )
            self.query_target = f"127.0.0.1:{qport}"
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.IndexerServiceStub | None = None
        self._reqs_tokens: list[pb.MatchRequest] = []
        self._reqs_keys: list[pb.MatchRequest] = []
        self._achannel: grpc.aio.Channel | None = None
        self._astub: Any = None
        self._ahealth: Any = None
        #: Probe Matches over one MatchStream, as router_client sends them
        #: (its own stream code), instead of one unary call each.
        self.probe_stream = False
        self._astream: Any = None
        self._schannel: grpc.aio.Channel | None = None
        self._sstream: Any = None

    def __enter__(self) -> KvmeshSide:
        self.child.start()
        try:
            self._channel = grpc.insecure_channel(self.target)
            self._stub = pb_grpc.IndexerServiceStub(self._channel)
            _wait_serving(self.child, self._channel)
            if self.query_child is not None:
                self.query_child.start()
                with grpc.insecure_channel(self.query_target) as channel:
                    _wait_serving(self.query_child, channel)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.query_child is not None:
            self.query_child.stop()
        self.child.stop()

    @property
    def stub(self) -> pb_grpc.IndexerServiceStub:
        assert self._stub is not None, "not started"
        return self._stub

    def prepare(self, model: str, queries: Sequence[Query]) -> None:
        bs = self.block_size
        self._reqs_tokens = [
            pb.MatchRequest(
                model=model,
                packed_token_ids=array("I", q.tokens).tobytes(),
                max_blocks=len(q.tokens) // bs,
            )
            for q in queries
        ]
        self._reqs_keys = [
            pb.MatchRequest(
                model=model,
                block_keys=block_keys(q.tokens, bs, model),
                max_blocks=len(q.tokens) // bs,
            )
            for q in queries
        ]

    @staticmethod
    def _answer(resp: pb.MatchResponse) -> Answer:
        return {_index_of(m.instance.worker_id): m.depth for m in resp.matches}

    def match_tokens(self, k: int) -> Answer:
        return self._answer(self.stub.Match(self._reqs_tokens[k]))

    def match_keys(self, k: int) -> Answer:
        return self._answer(self.stub.Match(self._reqs_keys[k]))

    def floor(self) -> None:
        self.stub.Ping(pb.PingRequest())

    def holders(self, model: str, tokens: Sequence[int]) -> Answer:
        return self._answer(self.stub.Match(pb.MatchRequest(model=model, token_ids=tokens)))

    def applied(self) -> dict[str, float]:
        s = self.stub.GetStats(pb.GetStatsRequest())
        return {
            "applied": float(s.batches_applied),
            "duplicate": float(s.batches_duplicate),
            "errors": float(s.batches_rejected),
        }

    def list_instances(self, model: str) -> int:
        """Instances of ``model`` the index has registered."""
        return len(self.stub.ListInstances(pb.ListInstancesRequest(model=model)).instances)

    def cpu_seconds(self) -> float | None:
        return self.child.cpu_seconds()

    def query_matches(self) -> int | None:
        """Matches the query replica has answered so far (GetStats; None: no such replica)."""
        if self.query_child is None:
            return None
        with grpc.insecure_channel(self.query_target) as channel:
            stats = pb_grpc.IndexerServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
        return int(stats.matches)

    def query_cpu_seconds(self) -> float | None:
        """CPU seconds of the query replica so far (None: there is none)."""
        return None if self.query_child is None else self.query_child.cpu_seconds()

    def proc_times(self) -> ProcTimes | None:
        return self.child.proc_times()

    def rss_bytes(self) -> float | None:
        mb = self.child.rss_mb()
        return None if mb is None else mb * 1024 * 1024

    async def aopen(self) -> None:
        self._achannel = grpc.aio.insecure_channel(self.query_target)
        self._astub = pb_grpc.IndexerServiceStub(self._achannel)
        self._ahealth = health_pb2_grpc.HealthStub(self._achannel)
        if self.probe_stream:
            from router_client.indexer_client import _MatchStream

            self._astream = _MatchStream(self._achannel, lambda s, code: None, lambda s: None)

    async def stream_open(self) -> None:
        """A MatchStream to the replica under test, for sequential Matches."""
        from router_client.indexer_client import _MatchStream

        self._schannel = grpc.aio.insecure_channel(self.target)
        self._sstream = _MatchStream(self._schannel, lambda s, code: None, lambda s: None)

    async def stream_close(self) -> None:
        await _close_stream(self._sstream, self._schannel)
        self._sstream = self._schannel = None

    @classmethod
    def _stream_answer(cls, reply: Any) -> Answer:
        if reply.code:
            raise RuntimeError(f"MatchStream reply {reply.code}: {reply.message[:60]}")
        return cls._answer(reply.match)

    async def _stream_ask(self, req: pb.MatchRequest) -> Answer:
        assert self._sstream is not None, "stream_open first"
        return self._stream_answer(await self._sstream.ask(req, STREAM_ASK_TIMEOUT_S))

    async def stream_tokens(self, k: int) -> Answer:
        return await self._stream_ask(self._reqs_tokens[k])

    async def stream_keys(self, k: int) -> Answer:
        return await self._stream_ask(self._reqs_keys[k])

    async def aclose(self) -> None:
        await _close_stream(self._astream, self._achannel)
        self._astream = self._achannel = None

    async def amatch_tokens(self, k: int, timeout_s: float) -> Answer:
        if self._astream is not None:
            return self._stream_answer(await self._astream.ask(self._reqs_tokens[k], timeout_s))
        return self._answer(await self._astub.Match(self._reqs_tokens[k], timeout=timeout_s))

    async def ahealth(self, timeout_s: float) -> None:
        await self._ahealth.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)

    async def aholders(self, model: str, tokens: Sequence[int]) -> Answer:
        req = pb.MatchRequest(model=model, token_ids=tokens)
        return self._answer(await self._astub.Match(req))


#: A sequential Match over a MatchStream fails past this.
STREAM_ASK_TIMEOUT_S = 10.0


async def _close_stream(stream: Any, channel: grpc.aio.Channel | None) -> None:
    """Close a MatchStream (if any), then its channel (if any)."""
    if stream is not None:
        await stream.close()
    if channel is not None:
        await channel.close()


def _wait_serving(child: ChildProcess, channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    child.wait_ready(
        lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == serving,
        START_TIMEOUT_S,
    )


def dynamo_instance_id(r: int, i: int) -> int:
    """Dynamo instance id of instance ``i`` in round ``r`` (unique across rounds)."""
    return r * 10_000 + i + 1


class DynamoSide:
    """Dynamo's standalone indexer in a child process, and its HTTP clients.

    Requests are JSON bodies encoded before the clock (a router in a compiled
    language encodes a request in microseconds; Python's ``json`` would take a
    millisecond of a 1,024-block query); answers are decoded inside the timed
    call, as gRPC decodes kvmesh's.
    """

    name = "dynamo"

    def __init__(self, work: Path, block_size: int, threads: int) -> None:
        self.block_size = block_size
        self.port = free_port()
        self.child = ChildProcess(
            [
                str(dynamo_python()),
                "-m",
                "dynamo.indexer",
                *("--port", str(self.port), "--threads", str(threads)),
            ],
            name="dynamo indexer",
            log_path=work / "dynamo-indexer.log",
            die_with_parent=True,
        )
        self._conn: http.client.HTTPConnection | None = None
        self._bodies_tokens: list[bytes] = []
        self._bodies_hash: list[bytes] = []
        self._session: aiohttp.ClientSession | None = None

    def __enter__(self) -> DynamoSide:
        self.child.start()
        try:
            self.child.wait_ready(lambda: self._get("/health")[0] == 200, START_TIMEOUT_S)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.child.stop()

    # -- HTTP, one keep-alive connection -------------------------------------

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            conn.connect()
            assert conn.sock is not None
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conn = conn
        return self._conn

    def _call(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        headers = {"content-type": "application/json"} if body is not None else {}
        for attempt in (0, 1):
            conn = self._connection()
            try:
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (http.client.HTTPException, ConnectionError):
                conn.close()
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _get(self, path: str) -> tuple[int, bytes]:
        return self._call("GET", path, None)

    def _post(self, path: str, body: bytes) -> Any:
        status, data = self._call("POST", path, body)
        if not 200 <= status < 300:
            raise RuntimeError(f"dynamo {path}: HTTP {status}: {data[:300]!r}")
        return json.loads(data) if data else None

    def register(self, r: int, model: str, eps: Sequence[tuple[str, str]]) -> None:
        """Register every publisher of round ``r`` under ``model`` (Dynamo subscribes)."""
        for i, (endpoint, replay) in enumerate(eps):
            body = {
                "instance_id": dynamo_instance_id(r, i),
                "endpoint": endpoint,
                "replay_endpoint": replay,
                "model_name": model,
                "block_size": self.block_size,
            }
            self._post("/register", json.dumps(body).encode())

    def _answer(self, doc: Any) -> Answer:
        bs = self.block_size
        out: Answer = {}
        for inst, ranks in (doc.get("scores") or {}).items():
            tokens = max(ranks.values()) if isinstance(ranks, dict) else ranks
            if tokens:
                out[(int(inst) - 1) % 10_000] = int(tokens) // bs
        return out

    def prepare(self, model: str, queries: Sequence[Query]) -> None:
        self._bodies_tokens = [
            json.dumps({"token_ids": q.tokens, "model_name": model}).encode() for q in queries
        ]
        self._bodies_hash = [
            json.dumps({"block_hashes": q.dynamo_hashes, "model_name": model}).encode()
            for q in queries
        ]

    def match_tokens(self, k: int) -> Answer:
        return self._answer(self._post("/query", self._bodies_tokens[k]))

    def match_keys(self, k: int) -> Answer:
        return self._answer(self._post("/query_by_hash", self._bodies_hash[k]))

    def floor(self) -> None:
        status, _ = self._get("/health")
        if status != 200:
            raise RuntimeError(f"dynamo /health: HTTP {status}")

    def holders(self, model: str, tokens: Sequence[int]) -> Answer:
        body = json.dumps({"token_ids": list(tokens), "model_name": model}).encode()
        return self._answer(self._post("/query", body))

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as name{labels} -> value."""
        status, data = self._get("/metrics")
        if status != 200:
            raise RuntimeError(f"dynamo /metrics: HTTP {status}")
        out: dict[str, float] = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out

    def applied(self) -> dict[str, float]:
        applied = errors = 0.0
        for name, value in self.metrics().items():
            if name.startswith("dynamo_kvrouter_kv_cache_events_applied{"):
                if 'status="ok"' in name:
                    applied += value
                else:
                    errors += value
        return {"applied": applied, "errors": errors}

    def cpu_seconds(self) -> float | None:
        return self.child.cpu_seconds()

    def query_cpu_seconds(self) -> float | None:
        return None

    def proc_times(self) -> ProcTimes | None:
        return self.child.proc_times()

    def rss_bytes(self) -> float | None:
        mb = self.child.rss_mb()
        return None if mb is None else mb * 1024 * 1024

    # -- async ----------------------------------------------------------------

    async def aopen(self) -> None:
        self._session = aiohttp.ClientSession(
            f"http://127.0.0.1:{self.port}",
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _apost(self, path: str, body: bytes, timeout_s: float) -> Any:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        headers = {"content-type": "application/json"}
        async with self._session.post(path, data=body, headers=headers, timeout=timeout) as r:
            data = await r.read()
            if not 200 <= r.status < 300:
                raise RuntimeError(f"dynamo {path}: HTTP {r.status}: {data[:300]!r}")
            return json.loads(data)

    async def amatch_tokens(self, k: int, timeout_s: float) -> Answer:
        return self._answer(await self._apost("/query", self._bodies_tokens[k], timeout_s))

    async def ahealth(self, timeout_s: float) -> None:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.get("/health", timeout=timeout) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"dynamo /health: HTTP {r.status}")

    async def aholders(self, model: str, tokens: Sequence[int]) -> Answer:
        body = json.dumps({"token_ids": list(tokens), "model_name": model}).encode()
        return self._answer(await self._apost("/query", body, 60.0))


def dynamo_hashes(queries: Sequence[Sequence[int]], block_size: int, work: Path) -> list[list[int]]:
    """Dynamo's local hashes of each query (``lab/engines/dynamo_hashes.py`` in its venv)."""
    from lab.engines.dynamo_hashes import write_queries

    src, dst = work / "queries.bin", work / "dynamo-hashes.json"
    write_queries(str(src), queries)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [str(dynamo_python()), "-m", "lab.engines.dynamo_hashes"]
    cmd += ["--block-size", str(block_size), str(src), str(dst)]
    subprocess.run(cmd, check=True, env=env, timeout=START_TIMEOUT_S)
    hashes: list[list[int]] = json.loads(dst.read_text(encoding="utf-8"))
    return hashes


async def wait_until(check: Any, timeout_s: float, what: str, interval_s: float = 0.01) -> None:
    """Await ``check()`` until true, ``interval_s`` apart; ``TimeoutError`` after ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    while not await check():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what}: not done after {timeout_s:.0f} s")
        await asyncio.sleep(interval_s)
