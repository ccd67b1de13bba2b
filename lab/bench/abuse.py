"""``kvmesh bench abuse``: issue 20's attacks on a default install, a victim measured in each.

The install: ``kvmesh indexer serve`` in a child process, memory backend,
mutual TLS and the policy ``kvmesh certs`` writes (each engine identity owns
exactly its own worker id), every limit and quota as shipped. The server
config may be changed with ``--indexer-config JSON`` (merged over it), which
is how a deliberately weakened install is measured. The ``http_*`` attacks
target ``kvmesh cachesim serve`` instead, in a child process with mutual TLS
on both ports and the same policy, every other setting as shipped except
``http_body_timeout_s``, which ``--quick`` sets to 1.5 s (the shipped 30 s
otherwise); ``--cachesim-config JSON`` is merged over its config. Each attack
runs alone, against a fresh server; its victim makes calm calls (one in
flight, at most :data:`VICTIM_RPS` a second, each with a
:data:`VICTIM_TIMEOUT_S` deadline) first for a baseline without the attack,
then while the attack runs. The
attacker runs in this process beside the victim (its own thread and event
loop), so its client work shares the interpreter with the victim's timing:
latency ratios are upper bounds of what the server alone adds.

Attacks, and what *refused* (``abuse_<attack>_refused`` = 1) means for each
(bounds are the shipped defaults, whatever ``--indexer-config`` or
``--cachesim-config`` says):

- ``register_flood`` (finding 1): engine-1 registers its worker id under dp
  ranks 0.. and under made-up models. Victim: engine-2 registering its own
  instances and router-0 Matching. Refused when engine-1 holds at most the
  shipped ``quotas.max_instances_per_identity`` instances and
  ``quotas.max_namespaces_per_identity`` namespaces, and after the flood
  engine-2 registers a new instance in the flooded namespace and in a new
  one, and the admin registers one.
- ``block_flood`` (finding 2): engine-1 publishes blocks of precomputed keys
  (65,536 a batch, one unary call in flight per dp rank) for its own
  instances as fast as it can for ``flood_s`` seconds. Victim as above.
  Refused when the index holds no more of its blocks than the shipped
  ``quotas.max_blocks_per_instance`` per instance and
  ``max_blocks_per_identity`` together, fewer than it offered (the publish
  rate or the block quotas turned the rest away), and the server's RSS grew
  by at most :data:`RSS_MB_PER_MILLION_BLOCKS` per million blocks of that
  quota plus :data:`RSS_SLACK_MB`.
- ``tls_stall`` (finding 6): :data:`STALL_CONNECTIONS` TCP connections that
  never send a ClientHello. Victim: a new client's first call (a fresh
  channel and connection per call). Refused when the server closed every
  one of them within the shipped ``limits.handshake_timeout_s`` plus
  :data:`STALL_SLACK_S`.
- ``revoked_stream`` (finding 3): engine-3 opens PublishEventsStream and has
  a batch applied; its identity is then removed from the policy file while
  the stream stays open, and it keeps sending a batch every
  :data:`REVOKE_BATCH_INTERVAL_S`. Victim: engine-2 publishing and router-0
  Matching. Refused when the stream ends PERMISSION_DENIED within the shipped
  ``auth.reload_interval_s`` plus :data:`REVOKE_SLACK_S` of the edit and no
  batch sent after that is applied.
- ``dump_under_cap`` (finding 6): the index is filled with
  ``dump_index_blocks`` blocks of engine-1, then the admin calls DumpIndex
  without ``max_blocks``. Victim as above. Refused when the dump returned at
  most :data:`DUMP_CAP_BLOCKS` blocks, said it was truncated, and the
  server's RSS (sampled every 10 ms) grew by at most :data:`DUMP_RSS_BOUND_MB`
  during it.
- ``http_nested_json`` (finding 5): router-0 (a caller the policy lets
  ingest) posts ``nested_requests`` bodies of :data:`NESTING_DEPTH` nested
  arrays or objects (under the body size limit) to ``/ingest_ids``. Victim:
  tee-0 posting a valid ingest to the same simulator over a kept-alive
  connection (its own per-client budget). Refused when every one is answered
  400 (never 500, never a dropped connection), no reply is longer than
  :data:`HTTP_REPLY_MAX_BYTES` (the input is not echoed), and the simulator
  answers ``/healthz`` and is alive after.
- ``http_oversize_body`` (finding 5): router-0 sends ``oversize_requests``
  requests announcing ``Content-Length`` :data:`OVERSIZE_ANNOUNCED_BYTES`
  (200 MiB), half with the first 15 bytes of a body, half with none, eight
  at a time. Victim as above. Refused when each is answered 413 within
  :data:`OVERSIZE_PROMPT_S` without the rest of its body having been sent,
  and the simulator's RSS grew by at most :data:`HTTP_RSS_SLACK_MB` during
  them.
- ``http_slow_body`` (finding 5): router-0 opens ``slow_connections``
  connections, each announcing a :data:`SLOW_ANNOUNCED_BYTES` body and
  sending 15 bytes of it; half then send a byte every
  ``slow_byte_interval_s``, half nothing more. Victim as above. Refused when
  every one is answered 408 and closed by the simulator within the
  ``http_body_timeout_s`` the bench sets (whatever ``--cachesim-config``
  says) plus :data:`SLOW_SLACK_S`, and once that deadline passed the
  simulator holds at most :data:`SLOW_FD_SLACK` more file descriptors than
  before the attack.

Per attack: ``abuse_<attack>_refused``, the victim's ok fraction during it
(``_victim_ok_fraction``, a call that fails or misses its deadline is not
ok) and at baseline, its p50/p99 during the attack (``_victim_p50_ms``,
``_victim_p99_ms``) and their ratio to the baseline (``_victim_p99_ratio``),
and the server's RSS before and after (``_rss_before_mb``, ``_rss_after_mb``,
``_rss_growth_mb``, from ``/proc/<pid>/status`` VmRSS of the child: the
indexer's, or the simulator's for the ``http_*`` attacks). The
command exits 1 when an attack is not refused or a victim's ok fraction
during an attack is below :data:`MIN_VICTIM_OK` (0.99).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import math
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer.config import Limits, Quotas
from kvmesh import progress
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.auth import AuthSettings
from kvmesh.clihelp import HelpFormatter
from kvmesh.configfile import merge
from kvmesh.stats import percentile
from kvmesh.tls import ChannelFactory, ClientTLS
from lab.bench.report import fmt, table, write_report
from lab.children import ChildProcess
from lab.devcerts import main as certs_main
from lab.redisproc import free_port
from tee.cachesim.config import CacheSimConfig
from tee.events import WORKER_HEADER
from tee.httpsec import ClientSSL

HOST = "127.0.0.1"
MODEL = "abuse/model"

#: The identities ``kvmesh certs`` issues for the run (name -> SAN); the
#: command gives each engine exactly its own worker id (the SAN's last segment).
IDENTITIES = {
    "server": f"localhost,{HOST}",
    "engine-1": "spiffe://kvmesh/engine/engine-1",  # the attacker
    "engine-2": "spiffe://kvmesh/engine/engine-2",  # the victim engine
    "engine-3": "spiffe://kvmesh/engine/engine-3",  # revoked mid-stream
    "router-0": "spiffe://kvmesh/router/router-0",  # the victim router; cachesim's attacker
    "tee-0": "spiffe://kvmesh/tee/tee-0",  # the cache simulator's victim
    "admin": "spiffe://kvmesh/admin/ops",
}

#: Victim pace: a calm client, one call in flight, far below what a replica serves.
VICTIM_RPS = 50.0
#: A victim call that takes longer is not ok: a router gives up on the indexer
#: well before this and routes on load.
VICTIM_TIMEOUT_S = 2.0
#: The victim's ok fraction under an attack below which the run fails.
MIN_VICTIM_OK = 0.99
#: Connections of ``tls_stall``: finding 6 opened 1,000.
STALL_CONNECTIONS = 1000
#: Seconds past the shipped handshake timeout a stalled connection may stay open.
STALL_SLACK_S = 5.0
#: block_flood: events of max_blocks_per_event keys per batch (65,536 blocks
#: a batch, as finding 2 sent).
BLOCK_FLOOD_EVENTS = 4
#: RSS a memory replica may grow by per million blocks the quotas let in:
#: SECURITY.md measured about 305 MB (1,048,576 blocks) and 222 MB (2,097,152
#: over 8 ranks) a million; 512 leaves room for the allocator, and a flood
#: without quotas (3.2 GB for 6.55 M blocks) is far above it.
RSS_MB_PER_MILLION_BLOCKS = 512.0
RSS_SLACK_MB = 64.0
#: Blocks a DumpIndex without max_blocks returns at most (indexer/logic.py DUMP_MAX_BLOCKS).
DUMP_CAP_BLOCKS = 100_000
#: Peak RSS growth a capped dump may cause, whatever the index's size.
DUMP_RSS_BOUND_MB = 256.0
#: Seconds between two batches of the revoked stream.
REVOKE_BATCH_INTERVAL_S = 0.1
#: Seconds past the shipped policy reload interval the revoked stream may still apply.
REVOKE_SLACK_S = 3.0
#: http_nested_json: levels of each nested body (finding 5 sent 100,000).
NESTING_DEPTH = 100_000
#: Bytes an error reply may have: it names the fault, it does not echo the input.
HTTP_REPLY_MAX_BYTES = 400
#: http_oversize_body: the Content-Length announced (finding 5: 200 MiB) and
#: the bytes of it sent before the reply is awaited.
OVERSIZE_ANNOUNCED_BYTES = 200 << 20
OVERSIZE_PREFIX = b'{"model": "m", '
#: Seconds an announced oversize body may take to be answered 413.
OVERSIZE_PROMPT_S = 1.0
#: RSS growth the oversize requests may cause (none of their bodies is buffered).
HTTP_RSS_SLACK_MB = 32.0
#: http_slow_body: the body size announced, and seconds past the body timeout a
#: slow connection may stay open (answered or not).
SLOW_ANNOUNCED_BYTES = 1000
SLOW_SLACK_S = 3.0
#: Server file descriptors that may still be open once the slow connections' deadline passed.
SLOW_FD_SLACK = 8


@dataclass(frozen=True, slots=True)
class Sizes:
    """Sizes of one run."""

    baseline_s: float = 3.0
    #: register_flood: dp ranks and made-up models engine-1 tries (finding 1:
    #: 4,096 instances under dp ranks 1...4,199 and 1,022 models).
    flood_ranks: int = 4200
    flood_models: int = 1100
    #: block_flood: seconds engine-1 publishes as fast as it can, over this many
    #: dp ranks of its worker id (finding 2: 6.55 M blocks in 24 s); 2 ranks
    #: reach the identity's block quota, not only an instance's.
    flood_s: float = 20.0
    flood_dp_ranks: int = 2
    #: dump_under_cap: blocks in the index the admin dumps (10x the dump's cap;
    #: --quick 4x).
    dump_index_blocks: int = 1_000_000
    #: The cache simulator attacks: nested bodies and oversize announcements
    #: sent, slow connections opened (finding 5 opened 200).
    nested_requests: int = 100
    oversize_requests: int = 100
    slow_connections: int = 200
    #: The simulator's ``http_body_timeout_s`` the bench sets (None: the shipped
    #: default), and seconds between two bytes of a slow body.
    http_body_timeout_s: float | None = None
    slow_byte_interval_s: float = 5.0


FULL = Sizes()
#: A CI-bounded run: still past every default quota, the figures indicative.
QUICK = Sizes(
    baseline_s=1.0,
    flood_ranks=300,
    flood_models=80,
    flood_s=3.0,
    dump_index_blocks=400_000,
    nested_requests=20,
    oversize_requests=20,
    slow_connections=50,
    http_body_timeout_s=1.5,
    slow_byte_interval_s=0.5,
)

ATTACKS = (
    "register_flood",
    "block_flood",
    "revoked_stream",
    "tls_stall",
    "dump_under_cap",
    "http_nested_json",
    "http_oversize_body",
    "http_slow_body",
)
#: The attacks on the cache simulator's HTTP ingest (the others attack the indexer).
HTTP_ATTACKS = ("http_nested_json", "http_oversize_body", "http_slow_body")


# -- the install ---------------------------------------------------------------------


@dataclass
class Install:
    """The PKI of the run, written by ``kvmesh certs``, and the server config."""

    folder: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    cachesim_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        argv = ["--out", str(self.folder)]
        for name, sans in IDENTITIES.items():
            argv += ["--identity", f"{name}={sans}"]
        with contextlib.redirect_stdout(sys.stderr):
            certs_main(argv)

    @property
    def ca(self) -> str:
        return str(self.folder / "ca.crt")

    def client(self, name: str) -> ClientTLS:
        return ClientTLS(
            ca_file=self.ca,
            cert_file=str(self.folder / f"{name}.crt"),
            key_file=str(self.folder / f"{name}.key"),
        )

    def config(self, port: int, health_port: int, policy: Path) -> dict[str, Any]:
        base: dict[str, Any] = {
            "host": HOST,
            "port": port,
            "metrics_port": 0,
            "health_port": health_port,
            "backend": "memory",
            "tls": {
                "cert_file": str(self.folder / "server.crt"),
                "key_file": str(self.folder / "server.key"),
                "client_ca_file": self.ca,
            },
            "auth": {"policy_file": str(policy)},
            "log_level": "WARNING",
        }
        return merge(base, self.overrides)

    def cachesim_config(self, http_port: int, grpc_port: int, sizes: Sizes) -> dict[str, Any]:
        base: dict[str, Any] = {
            "host": HOST,
            "http_port": http_port,
            "grpc_port": grpc_port,
            "tls": {
                "cert_file": str(self.folder / "server.crt"),
                "key_file": str(self.folder / "server.key"),
                "client_ca_file": self.ca,
            },
            "auth": {"policy_file": str(self.folder / "policy.yaml")},
            "log_level": "WARNING",
        }
        if sizes.http_body_timeout_s is not None:
            base["http_body_timeout_s"] = sizes.http_body_timeout_s
        return merge(base, self.cachesim_overrides)

    def ssl_context(self, name: str) -> ssl.SSLContext:
        """A client SSL context presenting ``name``'s certificate."""
        return ClientSSL(self.client(name), what="bench abuse").context


class Served:
    """A server child process: started until ready, stopped, its RSS and open fds."""

    child: ChildProcess

    def _healthy(self) -> bool:
        raise NotImplementedError

    def __enter__(self) -> Any:
        self.child.start()
        try:
            self.child.wait_ready(self._healthy)
        except BaseException:
            self.child.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.child.stop()

    def rss_mb(self) -> float:
        v = self.child.rss_mb()
        return math.nan if v is None else v

    def fds(self) -> int:
        try:
            return len(list(Path(f"/proc/{self.child.pid}/fd").iterdir()))
        except OSError:
            return -1


class Indexer(Served):
    """``kvmesh indexer serve`` in a child process, with a policy file of its own."""

    def __init__(self, install: Install, name: str) -> None:
        self.policy = install.folder / f"policy-{name}.yaml"
        self.policy.write_text((install.folder / "policy.yaml").read_text(), encoding="utf-8")
        port, health = free_port(), free_port()
        self.target = f"{HOST}:{port}"
        self.health_target = f"{HOST}:{health}"
        cfg = install.folder / f"indexer-{name}.json"
        cfg.write_text(json.dumps(install.config(port, health, self.policy)), encoding="utf-8")
        self.child = ChildProcess(
            [sys.executable, "-m", "kvmesh.cli", "indexer", "serve", "--config", str(cfg)],
            name=f"indexer ({name})",
            log_path=install.folder / f"indexer-{name}.log",
        )

    def _healthy(self) -> bool:
        with grpc.insecure_channel(self.health_target) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return bool(r.status == health_pb2.HealthCheckResponse.SERVING)

    def revoke(self, identity: str) -> None:
        """Remove ``identity`` from the policy file, as an operator would."""
        doc = yaml.safe_load(self.policy.read_text(encoding="utf-8"))
        doc["identities"] = [i for i in doc["identities"] if i["name"] != identity]
        self.policy.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")


class CacheSim(Served):
    """``kvmesh cachesim serve`` in a child process: mutual TLS on both ports, the run's policy."""

    def __init__(self, install: Install, name: str, sizes: Sizes) -> None:
        self.http_port, grpc_port = free_port(), free_port()
        self.url = f"https://{HOST}:{self.http_port}"
        self.config = install.cachesim_config(self.http_port, grpc_port, sizes)
        cfg = install.folder / f"cachesim-{name}.json"
        cfg.write_text(json.dumps(self.config), encoding="utf-8")
        self._ssl = install.ssl_context("tee-0")
        self.child = ChildProcess(
            [sys.executable, "-m", "kvmesh.cli", "cachesim", "serve", "--config", str(cfg)],
            name=f"cachesim ({name})",
            log_path=install.folder / f"cachesim-{name}.log",
        )

    def _healthy(self) -> bool:
        conn = http.client.HTTPSConnection(HOST, self.http_port, context=self._ssl, timeout=1)
        try:
            conn.request("GET", "/healthz")
            return conn.getresponse().status == 200
        finally:
            conn.close()


# -- the victim -------------------------------------------------------------------------


class Victim:
    """Calm calls in a thread of their own until stopped; each one's outcome and latency."""

    def __init__(
        self,
        op: Callable[[int], None],
        errors: tuple[type[BaseException], ...] = (grpc.RpcError,),
    ) -> None:
        self.op = op
        self.errors = errors
        self.results: list[tuple[bool, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._i = 0

    def _run(self) -> None:
        interval = 1.0 / VICTIM_RPS
        while not self._stop.is_set():
            t0 = time.perf_counter()
            ok = True
            try:
                self.op(self._i)
            except self.errors:
                ok = False
            took = time.perf_counter() - t0
            self.results.append((ok and took <= VICTIM_TIMEOUT_S, took * 1000))
            self._i += 1
            self._stop.wait(max(0.0, interval - took))

    def measure(self, seconds: float | None = None, until: Callable[[], Any] | None = None) -> Any:
        """Run for ``seconds``, or while ``until()`` runs (its result returned)."""
        self.results = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="victim", daemon=True)
        self._thread.start()
        try:
            if until is not None:
                return until()
            time.sleep(seconds or 0.0)
            return None
        finally:
            self._stop.set()
            self._thread.join()

    def figures(self) -> dict[str, float]:
        if not self.results:
            return {"ok_fraction": 0.0, "p50_ms": math.nan, "p99_ms": math.nan, "calls": 0}
        lat = [ms for ok, ms in self.results if ok] or [math.nan]
        return {
            "ok_fraction": sum(ok for ok, _ in self.results) / len(self.results),
            "p50_ms": percentile(lat, 0.5),
            "p99_ms": percentile(lat, 0.99),
            "calls": len(self.results),
        }


def _code(e: grpc.RpcError) -> str:
    return e.code().name if isinstance(e, grpc.Call) else type(e).__name__


def _keys(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def stored_keys(keys: Sequence[int]) -> pb.Event:
    """A BlockStored of precomputed block keys (engine hashes = keys)."""
    return pb.Event(
        stored=pb.BlockStored(block_hashes=list(keys), block_keys=list(keys), tier=pb.TIER_GPU)
    )


class Clients:
    """Blocking stubs of the run's identities against one server (closed together)."""

    def __init__(self, install: Install, target: str, names: Sequence[str]) -> None:
        self._channels: list[grpc.Channel] = []
        self.stubs: dict[str, pb_grpc.IndexerServiceStub] = {}
        for n in names:
            ch = ChannelFactory(target, install.client(n), what="bench abuse").sync_channel()
            self._channels.append(ch)
            self.stubs[n] = pb_grpc.IndexerServiceStub(ch)

    def __getitem__(self, name: str) -> pb_grpc.IndexerServiceStub:
        return self.stubs[name]

    def close(self) -> None:
        for ch in self._channels:
            ch.close()


def register(stub: pb_grpc.IndexerServiceStub, worker: str, rank: int, model: str) -> None:
    stub.RegisterInstance(
        pb.RegisterInstanceRequest(
            instance=pb.InstanceRef(worker_id=worker, dp_rank=rank),
            model=model,
            lease_ttl_seconds=600,
        ),
        timeout=VICTIM_TIMEOUT_S,
    )


VICTIM_PREFIX = _keys(1 << 40, 8)


def engine_and_router_victim(c: Clients, rank_base: int) -> Callable[[int], None]:
    """engine-2 registers an instance (dp ranks in turn) or publishes, router-0 Matches."""
    match = pb.MatchRequest(model=MODEL, block_keys=VICTIM_PREFIX, max_blocks=8)

    def op(i: int) -> None:
        if i % 2:
            c["router-0"].Match(match, timeout=VICTIM_TIMEOUT_S)
        elif i % 4 == 0:
            register(c["engine-2"], "engine-2", rank_base + (i // 4) % 64, MODEL)
        else:
            b = pb.EventBatch(
                instance=pb.InstanceRef(worker_id="engine-2", dp_rank=0),
                sequence=0,
                events=[stored_keys(VICTIM_PREFIX)],
            )
            c["engine-2"].PublishEvents(pb.PublishEventsRequest(batch=b), timeout=VICTIM_TIMEOUT_S)

    return op


# -- the attacks -------------------------------------------------------------------------


def attack_register_flood(
    install: Install, srv: Indexer, sizes: Sizes
) -> tuple[Victim, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], bool]]:
    c = Clients(install, srv.target, ["engine-1", "engine-2", "router-0", "admin"])
    register(c["engine-2"], "engine-2", 0, MODEL)
    victim = Victim(engine_and_router_victim(c, 0))

    def attack() -> dict[str, Any]:
        async def flood() -> dict[str, Any]:
            specs = [(r, MODEL) for r in range(sizes.flood_ranks)]
            # Made-up models on dp ranks of its own worker id (the only one it owns).
            specs += [(m, f"made-up-{m}") for m in range(sizes.flood_models)]
            gate = asyncio.Semaphore(32)
            refused: dict[str, int] = {}
            ok = 0
            tls = install.client("engine-1")
            async with ChannelFactory(srv.target, tls, what="bench abuse").channel() as ch:
                stub = pb_grpc.IndexerServiceStub(ch)

                async def one(rank: int, model: str) -> None:
                    nonlocal ok
                    async with gate:
                        try:
                            await stub.RegisterInstance(
                                pb.RegisterInstanceRequest(
                                    instance=pb.InstanceRef(worker_id="engine-1", dp_rank=rank),
                                    model=model,
                                    lease_ttl_seconds=600,
                                ),
                                timeout=30,
                            )
                            ok += 1
                        except grpc.aio.AioRpcError as e:
                            refused[e.code().name] = refused.get(e.code().name, 0) + 1

                await asyncio.gather(*(one(r, m) for r, m in specs))
            return {"registered": ok, "refused": refused, "tried": len(specs)}

        return asyncio.run(flood())

    def judge(out: dict[str, Any]) -> bool:
        listed = c["admin"].ListInstances(pb.ListInstancesRequest(), timeout=10)
        held = [i for i in listed.instances if i.instance.worker_id == "engine-1"]
        models = {i.model for i in held}
        out["attacker_instances"] = len(held)
        out["attacker_namespaces"] = len(models)
        after: dict[str, str] = {}
        checks: tuple[tuple[str, Callable[[], None]], ...] = (
            ("engine_new_instance", lambda: register(c["engine-2"], "engine-2", 200, MODEL)),
            ("engine_new_namespace", lambda: register(c["engine-2"], "engine-2", 201, "fresh")),
            ("admin", lambda: register(c["admin"], "ops-0", 0, MODEL)),
        )
        for label, call in checks:
            try:
                call()
                after[label] = "OK"
            except grpc.RpcError as e:
                after[label] = _code(e)
        out["after_flood"] = after
        c.close()
        q = Quotas()
        return (
            len(held) <= q.max_instances_per_identity
            and len(models) <= q.max_namespaces_per_identity
            and all(v == "OK" for v in after.values())
        )

    return victim, attack, judge


def attack_tls_stall(
    install: Install, srv: Indexer, sizes: Sizes
) -> tuple[Victim, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], bool]]:
    tls = install.client("router-0")

    def op(i: int) -> None:
        factory = ChannelFactory(
            srv.target, tls, options=[("grpc.use_local_subchannel_pool", 1)], what="bench abuse"
        )
        with factory.sync_channel() as ch:
            pb_grpc.IndexerServiceStub(ch).Ping(pb.PingRequest(), timeout=VICTIM_TIMEOUT_S)

    victim = Victim(op)
    deadline_s = Limits().handshake_timeout_s + STALL_SLACK_S

    def attack() -> dict[str, Any]:
        host, port = srv.target.rsplit(":", 1)
        fds0 = srv.fds()
        socks: list[socket.socket] = []
        opened: list[float] = []
        for _ in range(STALL_CONNECTIONS):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.setblocking(False)
            socks.append(s)
            opened.append(time.monotonic())
        time.sleep(0.5)
        peak = srv.fds() - fds0
        closed_after: list[float | None] = [None] * len(socks)
        end = opened[-1] + deadline_s
        while time.monotonic() < end and any(v is None for v in closed_after):
            for k, s in enumerate(socks):
                if closed_after[k] is not None:
                    continue
                try:
                    data = s.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    closed_after[k] = time.monotonic() - opened[k]
            time.sleep(0.05)
        for s in socks:
            s.close()
        closed = [v for v in closed_after if v is not None]
        return {
            "connections": len(socks),
            "closed_fraction": len(closed) / len(socks),
            "close_s_max": max(closed) if closed else math.nan,
            "server_fds_during": peak,
        }

    def judge(out: dict[str, Any]) -> bool:
        return bool(out["closed_fraction"] == 1.0 and out["close_s_max"] <= deadline_s)

    return victim, attack, judge


def attack_revoked_stream(
    install: Install, srv: Indexer, sizes: Sizes
) -> tuple[Victim, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], bool]]:
    c = Clients(install, srv.target, ["engine-2", "router-0", "engine-3"])
    register(c["engine-2"], "engine-2", 0, MODEL)
    register(c["engine-3"], "engine-3", 0, MODEL)
    victim = Victim(engine_and_router_victim(c, 0))
    deadline_s = AuthSettings().reload_interval_s + REVOKE_SLACK_S

    def attack() -> dict[str, Any]:
        async def run() -> dict[str, Any]:
            tls = install.client("engine-3")
            applied_after = 0
            cutoff = math.nan
            code = "none"
            async with ChannelFactory(srv.target, tls, what="bench abuse").channel() as ch:
                call = pb_grpc.IndexerServiceStub(ch).PublishEventsStream(timeout=deadline_s + 30)

                def req(seq: int) -> pb.PublishEventsStreamRequest:
                    b = pb.EventBatch(
                        instance=pb.InstanceRef(worker_id="engine-3", dp_rank=0),
                        sequence=seq,
                        events=[stored_keys(_keys((2 << 40) + seq * 4, 4))],
                    )
                    return pb.PublishEventsStreamRequest(batch=b)

                await call.write(req(0))
                got: Any = await call.read()
                first = got.ack.outcome == pb.BATCH_OUTCOME_APPLIED
                srv.revoke("engine-3")
                t0 = time.monotonic()
                seq = 1
                try:
                    while time.monotonic() - t0 < deadline_s + 2:
                        sent_at = time.monotonic() - t0
                        await call.write(req(seq))
                        resp: Any = await call.read()
                        if resp is grpc.aio.EOF:
                            break
                        if resp.ack.outcome == pb.BATCH_OUTCOME_APPLIED and sent_at > deadline_s:
                            applied_after += 1
                        seq += 1
                        await asyncio.sleep(REVOKE_BATCH_INTERVAL_S)
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                    cutoff = time.monotonic() - t0
                except grpc.aio.UsageError:
                    code = (await call.code()).name if call.done() else "usage"
                    cutoff = time.monotonic() - t0
                call.cancel()
            return {
                "first_applied": first,
                "ended": code,
                "cutoff_s": cutoff,
                "applied_after_deadline": applied_after,
                "batches_sent": seq,
            }

        return asyncio.run(run())

    def judge(out: dict[str, Any]) -> bool:
        c.close()
        return bool(
            out["first_applied"]
            and out["ended"] == "PERMISSION_DENIED"
            and out["cutoff_s"] <= deadline_s
            and out["applied_after_deadline"] == 0
        )

    return victim, attack, judge


def attack_block_flood(
    install: Install, srv: Indexer, sizes: Sizes
) -> tuple[Victim, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], bool]]:
    c = Clients(install, srv.target, ["engine-1", "engine-2", "router-0", "admin"])
    register(c["engine-2"], "engine-2", 0, MODEL)
    for r in range(sizes.flood_dp_ranks):
        register(c["engine-1"], "engine-1", r, MODEL)
    victim = Victim(engine_and_router_victim(c, 0))
    rss0 = srv.rss_mb()
    q = Quotas()
    cap = min(sizes.flood_dp_ranks * q.max_blocks_per_instance, q.max_blocks_per_identity)

    def attack() -> dict[str, Any]:
        async def run() -> dict[str, Any]:
            tls = install.client("engine-1")
            offered = stored = skipped = 0
            refused: dict[str, int] = {}
            per_event = Limits().max_blocks_per_event
            per_batch = per_event * BLOCK_FLOOD_EVENTS
            stop_at = time.monotonic() + sizes.flood_s
            opts = [("grpc.max_send_message_length", 64 << 20)]
            async with ChannelFactory(
                srv.target, tls, options=opts, what="bench abuse"
            ).channel() as ch:
                stub = pb_grpc.IndexerServiceStub(ch)

                async def sender(rank: int) -> None:
                    # One sender per dp rank: each instance's sequence stays in order.
                    nonlocal offered, stored, skipped
                    seq = 0
                    while time.monotonic() < stop_at:
                        base = 1 + (seq * sizes.flood_dp_ranks + rank) * per_batch
                        b = pb.EventBatch(
                            instance=pb.InstanceRef(worker_id="engine-1", dp_rank=rank),
                            sequence=seq,
                            events=[
                                stored_keys(_keys(base + j * per_event, per_event))
                                for j in range(BLOCK_FLOOD_EVENTS)
                            ],
                        )
                        offered += per_batch
                        try:
                            resp = await stub.PublishEvents(
                                pb.PublishEventsRequest(batch=b), timeout=60
                            )
                            stored += resp.ack.blocks_stored
                            skipped += resp.ack.blocks_skipped
                            seq += 1
                        except grpc.aio.AioRpcError as e:
                            refused[e.code().name] = refused.get(e.code().name, 0) + 1

                await asyncio.gather(*(sender(r) for r in range(sizes.flood_dp_ranks)))
            return {
                "offered_blocks": offered,
                "stored_blocks": stored,
                "skipped_blocks": skipped,
                "refused_batches": refused,
            }

        return asyncio.run(run())

    def judge(out: dict[str, Any]) -> bool:
        listed = c["admin"].ListInstances(pb.ListInstancesRequest(), timeout=10)
        held = sum(int(i.blocks) for i in listed.instances if i.instance.worker_id == "engine-1")
        growth = srv.rss_mb() - rss0
        bound = cap / 1e6 * RSS_MB_PER_MILLION_BLOCKS + RSS_SLACK_MB
        out.update(held_blocks=held, quota_blocks=cap, rss_growth_bound_mb=bound)
        c.close()
        return held <= cap and held < out["offered_blocks"] and growth <= bound

    return victim, attack, judge


def fill(install: Install, srv: Indexer, blocks: int) -> int:
    """engine-1 publishes ``blocks`` blocks of precomputed keys over 2 dp ranks,
    waiting whenever the publish rate refuses a batch; the blocks stored."""

    async def run() -> int:
        per_event = Limits().max_blocks_per_event
        stored = 0
        opts = [("grpc.max_send_message_length", 64 << 20)]
        tls = install.client("engine-1")
        async with ChannelFactory(
            srv.target, tls, options=opts, what="bench abuse"
        ).channel() as ch:
            stub = pb_grpc.IndexerServiceStub(ch)
            for r in range(2):
                await stub.RegisterInstance(
                    pb.RegisterInstanceRequest(
                        instance=pb.InstanceRef(worker_id="engine-1", dp_rank=r), model=MODEL
                    ),
                    timeout=10,
                )
            seq = 0
            while seq * per_event < blocks:
                b = pb.EventBatch(
                    instance=pb.InstanceRef(worker_id="engine-1", dp_rank=seq % 2),
                    sequence=seq // 2,
                    events=[stored_keys(_keys(1 + seq * per_event, per_event))],
                )
                try:
                    resp = await stub.PublishEvents(pb.PublishEventsRequest(batch=b), timeout=60)
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    await asyncio.sleep(0.05)
                    continue
                stored += resp.ack.blocks_stored
                seq += 1
        return stored

    return asyncio.run(run())


def attack_dump_under_cap(
    install: Install, srv: Indexer, sizes: Sizes
) -> tuple[Victim, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], bool]]:
    c = Clients(install, srv.target, ["engine-2", "router-0"])
    register(c["engine-2"], "engine-2", 0, MODEL)
    progress.phase(f"dump_under_cap: filling the index with {sizes.dump_index_blocks:,} blocks")
    held = fill(install, srv, sizes.dump_index_blocks)
    victim = Victim(engine_and_router_victim(c, 0))

    def attack() -> dict[str, Any]:
        rss0 = srv.rss_mb()
        peak = rss0
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.01):
                peak = max(peak, srv.rss_mb())

        sampler = threading.Thread(target=sample, name="rss", daemon=True)
        sampler.start()
        returned = 0
        truncated = False
        t0 = time.perf_counter()
        try:
            tls = install.client("admin")
            with ChannelFactory(srv.target, tls, what="bench abuse").sync_channel() as ch:
                for resp in pb_grpc.IndexerServiceStub(ch).DumpIndex(
                    pb.DumpIndexRequest(), timeout=120
                ):
                    returned += len(resp.blocks)
                    truncated = truncated or resp.truncated
        finally:
            done.set()
            sampler.join()
        return {
            "index_blocks": held,
            "returned_blocks": returned,
            "truncated": truncated,
            "dump_s": time.perf_counter() - t0,
            "rss_peak_growth_mb": peak - rss0,
        }

    def judge(out: dict[str, Any]) -> bool:
        c.close()
        out["rss_peak_growth_bound_mb"] = DUMP_RSS_BOUND_MB
        return bool(
            out["returned_blocks"] <= DUMP_CAP_BLOCKS
            and out["truncated"]
            and out["rss_peak_growth_mb"] <= DUMP_RSS_BOUND_MB
        )

    return victim, attack, judge


# -- the cache simulator's HTTP ingest ---------------------------------------------------


class HttpRefused(Exception):
    """A victim's ingest answered other than 200."""


#: The victim's ingest: 4 blocks of the simulator's default 16 tokens.
VICTIM_INGEST = json.dumps({"model": MODEL, "input_ids": list(range(64))}).encode()


class IngestVictim(Victim):
    """tee-0 posting a valid ingest over one kept-alive connection (reopened after a failure)."""

    def __init__(self, sim: CacheSim, install: Install) -> None:
        super().__init__(self._post, errors=(OSError, http.client.HTTPException, HttpRefused))
        self._sim = sim
        self._ssl = install.ssl_context("tee-0")
        self._conn: http.client.HTTPSConnection | None = None

    def _post(self, i: int) -> None:
        if self._conn is None:
            self._conn = http.client.HTTPSConnection(
                HOST, self._sim.http_port, context=self._ssl, timeout=VICTIM_TIMEOUT_S
            )
        try:
            self._conn.request(
                "POST",
                "/ingest_ids",
                body=VICTIM_INGEST,
                headers={"Content-Type": "application/json", WORKER_HEADER: "w0"},
            )
            r = self._conn.getresponse()
            r.read()
        except BaseException:
            self.close()
            raise
        if r.status != 200:
            raise HttpRefused(f"HTTP {r.status}")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def body_timeout_s(sizes: Sizes) -> float:
    """The body timeout the bench sets: the criterion's bound, whatever --cachesim-config says."""
    if sizes.http_body_timeout_s is not None:
        return sizes.http_body_timeout_s
    return float(CacheSimConfig().http_body_timeout_s)


def post_head(sim: CacheSim, length: int) -> bytes:
    return (
        f"POST /ingest_ids HTTP/1.1\r\nHost: {HOST}:{sim.http_port}\r\n"
        f"Content-Type: application/json\r\n{WORKER_HEADER}: w9\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def nested_bodies(depth: int) -> list[bytes]:
    """Arrays and objects nested ``depth`` levels (under the body size limit)."""
    return [
        b"[" * depth + b"]" * depth,
        b'{"a":' * depth + b"1" + b"}" * depth,
        b'{"model": "m", "input_ids": ' + b"[" * depth + b"]" * depth + b"}",
    ]


def attack_http_nested_json(
    install: Install, sim: CacheSim, sizes: Sizes
) -> tuple[Victim, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], bool]]:
    victim = IngestVictim(sim, install)
    ctx = install.ssl_context("router-0")
    bodies = nested_bodies(NESTING_DEPTH)

    def attack() -> dict[str, Any]:
        async def run() -> dict[str, Any]:
            statuses: dict[str, int] = {}
            longest = 0
            errors = 0
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
                for k in range(sizes.nested_requests):
                    try:
                        async with s.post(
                            f"{sim.url}/ingest_ids",
                            data=bodies[k % len(bodies)],
                            headers={"Content-Type": "application/json"},
                            timeout=aiohttp.ClientTimeout(total=30),
                        ) as r:
                            reply = await r.read()
                        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
                        longest = max(longest, len(reply))
                    except (aiohttp.ClientError, TimeoutError):
                        errors += 1
                async with s.get(f"{sim.url}/healthz", timeout=aiohttp.ClientTimeout(5)) as r:
                    healthy = r.status == 200
            return {
                "requests": sizes.nested_requests,
                "depth": NESTING_DEPTH,
                "body_bytes_max": max(len(b) for b in bodies),
                "statuses": statuses,
                "client_errors": errors,
                "reply_bytes_max": longest,
                "healthy_after": healthy,
            }

        return asyncio.run(run())

    def judge(out: dict[str, Any]) -> bool:
        victim.close()
        out["alive_after"] = sim.child.alive()
        return bool(
            out["statuses"] == {"400": sizes.nested_requests}
            and out["reply_bytes_max"] <= HTTP_REPLY_MAX_BYTES
            and out["healthy_after"]
            and out["alive_after"]
        )

    return victim, attack, judge


async def _status_line(reader: asyncio.StreamReader) -> int:
    line = await reader.readline()
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0


def attack_http_oversize_body(
    install: Install, sim: CacheSim, sizes: Sizes
) -> tuple[Victim, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], bool]]:
    victim = IngestVictim(sim, install)
    ctx = install.ssl_context("router-0")
    head = post_head(sim, OVERSIZE_ANNOUNCED_BYTES)

    def attack() -> dict[str, Any]:
        rss0 = sim.rss_mb()

        async def run() -> dict[str, Any]:
            statuses: dict[str, int] = {}
            took: list[float] = []
            gate = asyncio.Semaphore(8)

            async def one(k: int) -> None:
                async with gate:
                    reader, writer = await asyncio.open_connection(HOST, sim.http_port, ssl=ctx)
                    try:
                        t0 = time.monotonic()
                        # Half send a little of the body, half none of it.
                        writer.write(head + (OVERSIZE_PREFIX if k % 2 else b""))
                        await writer.drain()
                        try:
                            async with asyncio.timeout(10 * OVERSIZE_PROMPT_S):
                                status = await _status_line(reader)
                        except TimeoutError:
                            status = 0
                        took.append(time.monotonic() - t0)
                        statuses[str(status)] = statuses.get(str(status), 0) + 1
                    except OSError:
                        statuses["error"] = statuses.get("error", 0) + 1
                    finally:
                        writer.close()

            await asyncio.gather(*(one(k) for k in range(sizes.oversize_requests)))
            return {
                "requests": sizes.oversize_requests,
                "announced_bytes": OVERSIZE_ANNOUNCED_BYTES,
                "sent_body_bytes_max": len(OVERSIZE_PREFIX),
                "statuses": statuses,
                "answer_s_max": max(took) if took else math.nan,
            }

        out = asyncio.run(run())
        out["rss_growth_mb"] = sim.rss_mb() - rss0
        return out

    def judge(out: dict[str, Any]) -> bool:
        victim.close()
        out.update(answer_s_bound=OVERSIZE_PROMPT_S, rss_growth_bound_mb=HTTP_RSS_SLACK_MB)
        return bool(
            out["statuses"] == {"413": sizes.oversize_requests}
            and out["answer_s_max"] <= OVERSIZE_PROMPT_S
            and out["rss_growth_mb"] <= HTTP_RSS_SLACK_MB
        )

    return victim, attack, judge


def attack_http_slow_body(
    install: Install, sim: CacheSim, sizes: Sizes
) -> tuple[Victim, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], bool]]:
    victim = IngestVictim(sim, install)
    ctx = install.ssl_context("router-0")
    head = post_head(sim, SLOW_ANNOUNCED_BYTES)
    deadline_s = body_timeout_s(sizes) + SLOW_SLACK_S

    def attack() -> dict[str, Any]:
        async def run() -> dict[str, Any]:
            fds0 = sim.fds()
            opened = asyncio.Event()
            tried = 0
            statuses: dict[str, int] = {}
            answered: list[float] = []
            closed: list[float] = []
            writers: list[asyncio.StreamWriter] = []

            async def dribble(writer: asyncio.StreamWriter) -> None:
                with contextlib.suppress(OSError, RuntimeError):
                    while True:
                        await asyncio.sleep(sizes.slow_byte_interval_s)
                        writer.write(b" ")
                        await writer.drain()

            async def one(k: int) -> None:
                nonlocal tried
                try:
                    reader, writer = await asyncio.open_connection(HOST, sim.http_port, ssl=ctx)
                except OSError:
                    statuses["connect_error"] = statuses.get("connect_error", 0) + 1
                    return
                finally:
                    tried += 1
                    if tried == sizes.slow_connections:
                        opened.set()
                t0 = time.monotonic()
                writers.append(writer)
                writer.write(head + OVERSIZE_PREFIX)
                # Half send a byte every slow_byte_interval_s, half nothing more.
                sender = asyncio.create_task(dribble(writer)) if k % 2 else None
                status = 0
                try:
                    async with asyncio.timeout(deadline_s):
                        status = await _status_line(reader)
                        answered.append(time.monotonic() - t0)
                        while await reader.read(65536):
                            pass
                    closed.append(time.monotonic() - t0)
                except TimeoutError:
                    pass
                except (OSError, ssl.SSLError):
                    closed.append(time.monotonic() - t0)
                finally:
                    statuses[str(status)] = statuses.get(str(status), 0) + 1
                    if sender is not None:
                        sender.cancel()

            tasks = [asyncio.create_task(one(k)) for k in range(sizes.slow_connections)]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(opened.wait(), 30)
            await asyncio.sleep(min(0.5, body_timeout_s(sizes) / 2))
            peak = sim.fds() - fds0
            _, pending = await asyncio.wait(tasks, timeout=deadline_s + 30)
            for t in pending:
                t.cancel()
            # Past the deadline: what the server still holds before this end closes its own.
            await asyncio.sleep(0.1)
            left = sim.fds() - fds0
            for w in writers:
                w.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await asyncio.gather(
                        *(w.wait_closed() for w in writers), return_exceptions=True
                    )
            return {
                "connections": sizes.slow_connections,
                "statuses": statuses,
                "answered_s_max": max(answered) if answered else math.nan,
                "closed_fraction": len(closed) / sizes.slow_connections,
                "closed_s_max": max(closed) if closed else math.nan,
                "server_fds_during": peak,
                "server_fds_after": left,
            }

        return asyncio.run(run())

    def judge(out: dict[str, Any]) -> bool:
        victim.close()
        out.update(deadline_s=deadline_s, body_timeout_s=body_timeout_s(sizes))
        return bool(
            out["statuses"] == {"408": sizes.slow_connections}
            and out["closed_fraction"] == 1.0
            and out["closed_s_max"] <= deadline_s
            and out["server_fds_after"] <= SLOW_FD_SLACK
        )

    return victim, attack, judge


RUNNERS: dict[str, Callable[..., Any]] = {
    "register_flood": attack_register_flood,
    "block_flood": attack_block_flood,
    "revoked_stream": attack_revoked_stream,
    "tls_stall": attack_tls_stall,
    "dump_under_cap": attack_dump_under_cap,
    "http_nested_json": attack_http_nested_json,
    "http_oversize_body": attack_http_oversize_body,
    "http_slow_body": attack_http_slow_body,
}


def run_attack(name: str, install: Install, sizes: Sizes) -> tuple[dict[str, float], Any]:
    """One attack against a fresh server: baseline, attack with its victim, figures."""
    srv: Served
    if name in HTTP_ATTACKS:
        progress.phase(f"{name}: starting the cache simulator")
        srv = CacheSim(install, name, sizes)
    else:
        progress.phase(f"{name}: starting the indexer")
        srv = Indexer(install, name)
    with srv:
        victim, attack, judge = RUNNERS[name](install, srv, sizes)
        progress.phase(f"{name}: victim baseline for {sizes.baseline_s:g} s")
        victim.measure(sizes.baseline_s)
        base = victim.figures()
        rss0 = srv.rss_mb()
        progress.phase(f"{name}: attack")
        detail = victim.measure(until=attack)
        during = victim.figures()
        rss1 = srv.rss_mb()
        refused = judge(detail)
    p = f"abuse_{name}"
    figures = {
        f"{p}_refused": 1.0 if refused else 0.0,
        f"{p}_victim_ok_fraction": during["ok_fraction"],
        f"{p}_victim_baseline_ok_fraction": base["ok_fraction"],
        f"{p}_victim_p50_ms": during["p50_ms"],
        f"{p}_victim_p99_ms": during["p99_ms"],
        f"{p}_victim_baseline_p50_ms": base["p50_ms"],
        f"{p}_victim_baseline_p99_ms": base["p99_ms"],
        f"{p}_victim_p99_ratio": during["p99_ms"] / base["p99_ms"],
        f"{p}_victim_calls": float(during["calls"]),
        f"{p}_rss_before_mb": rss0,
        f"{p}_rss_after_mb": rss1,
        f"{p}_rss_growth_mb": rss1 - rss0,
    }
    return figures, detail


FIGURE_SUFFIXES = (
    "refused",
    "victim_ok_fraction",
    "victim_p50_ms",
    "victim_p99_ms",
    "victim_p99_ratio",
    "rss_growth_mb",
)


def format_table(figures: dict[str, float], attacks: Sequence[str]) -> str:
    head = (
        f"{'attack':<18} {'refused':>7} {'victim ok':>9} {'base ok':>8} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'base p99':>8} {'p99 ratio':>9} {'RSS MB':>7} {'growth':>7}"
    )
    lines = []
    for a in attacks:

        def g(s: str, a: str = a) -> float:
            return figures[f"abuse_{a}_{s}"]

        lines.append(
            f"{a:<18} {'yes' if g('refused') else 'NO':>7} {g('victim_ok_fraction'):>9.3f} "
            f"{g('victim_baseline_ok_fraction'):>8.3f} {fmt(g('victim_p50_ms')):>7} "
            f"{fmt(g('victim_p99_ms')):>7} {fmt(g('victim_baseline_p99_ms')):>8} "
            f"{g('victim_p99_ratio'):>9.2f} {fmt(g('rss_after_mb')):>7} "
            f"{g('rss_growth_mb'):>7.1f}"
        )
    footer = (
        f"victim: calm calls, <= {VICTIM_RPS:g}/s, ok = answered within {VICTIM_TIMEOUT_S:g} s; "
        "base: the same victim without the attack; ratio: p99 during / p99 baseline; "
        "RSS of the server after the attack and its growth during it"
    )
    return table(head, lines, [footer])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh bench abuse``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench abuse",
        description="Issue 20's attacks on a default install (mutual TLS, the policy kvmesh "
        "certs writes, shipped limits and quotas), each alone with a victim measured.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--json", dest="json_path", help="also write figures and params here")
    p.add_argument("--quick", action="store_true", help="CI-bounded sizes: figures indicative")
    p.add_argument(
        "--attacks",
        default="all",
        help=f"comma-separated attacks to run, or all (of {', '.join(ATTACKS)})",
    )
    p.add_argument(
        "--indexer-config",
        default="",
        metavar="JSON",
        help="merged over the indexer's config: a deliberately weakened install, e.g. "
        '\'{"quotas": {"max_instances_per_identity": 0}}\'',
    )
    p.add_argument(
        "--cachesim-config",
        default="",
        metavar="JSON",
        help="merged over the cache simulator's config (the http_* attacks), e.g. "
        "'{\"http_body_timeout_s\": 600}'",
    )
    args = p.parse_args(argv)
    chosen = ",".join(ATTACKS) if args.attacks == "all" else args.attacks
    attacks = [a.strip() for a in chosen.split(",") if a.strip()]
    unknown = [a for a in attacks if a not in RUNNERS]
    if unknown or not attacks:
        p.error(f"--attacks: unknown {', '.join(unknown) or '(none)'}; known: {', '.join(ATTACKS)}")
    try:
        overrides = json.loads(args.indexer_config) if args.indexer_config else {}
    except ValueError as e:
        p.error(f"--indexer-config: not JSON: {e}")
    if not isinstance(overrides, dict):
        p.error("--indexer-config: must be a JSON object")
    try:
        sim_overrides = json.loads(args.cachesim_config) if args.cachesim_config else {}
    except ValueError as e:
        p.error(f"--cachesim-config: not JSON: {e}")
    if not isinstance(sim_overrides, dict):
        p.error("--cachesim-config: must be a JSON object")
    sizes = QUICK if args.quick else FULL
    try:
        CacheSimConfig.model_validate(sim_overrides)
    except ValueError as e:  # pydantic's ValidationError, naming the field
        p.error(f"--cachesim-config: {e}")
    t0 = time.perf_counter()
    figures: dict[str, float] = {}
    details: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-abuse-") as tmp:
        install = Install(Path(tmp), overrides, sim_overrides)
        for a in attacks:
            f, d = run_attack(a, install, sizes)
            figures.update(f)
            details[a] = d
    not_refused = [a for a in attacks if not figures[f"abuse_{a}_refused"]]
    hurt = [a for a in attacks if figures[f"abuse_{a}_victim_ok_fraction"] < MIN_VICTIM_OK]
    print(
        f"kvmesh bench abuse: {len(attacks)} attacks, memory backend, mutual TLS, policy of "
        f"kvmesh certs{', config overridden' if overrides or sim_overrides else ''}; "
        f"{time.perf_counter() - t0:.0f} s"
    )
    print(format_table(figures, attacks))
    if not_refused:
        print(f"not refused: {', '.join(not_refused)}")
    if hurt:
        print(f"victim ok fraction below {MIN_VICTIM_OK}: {', '.join(hurt)}")
    if args.json_path:
        params = {
            "attacks": attacks,
            "quick": args.quick,
            "indexer_config_overrides": overrides,
            "cachesim_config_overrides": sim_overrides,
            "victim_rps": VICTIM_RPS,
            "victim_timeout_s": VICTIM_TIMEOUT_S,
            "min_victim_ok": MIN_VICTIM_OK,
            "stall_connections": STALL_CONNECTIONS,
            "baseline_s": sizes.baseline_s,
            "flood_ranks": sizes.flood_ranks,
            "flood_models": sizes.flood_models,
            "flood_s": sizes.flood_s,
            "flood_dp_ranks": sizes.flood_dp_ranks,
            "dump_index_blocks": sizes.dump_index_blocks,
            "nested_requests": sizes.nested_requests,
            "nesting_depth": NESTING_DEPTH,
            "oversize_requests": sizes.oversize_requests,
            "oversize_announced_bytes": OVERSIZE_ANNOUNCED_BYTES,
            "slow_connections": sizes.slow_connections,
            "slow_byte_interval_s": sizes.slow_byte_interval_s,
            "http_body_timeout_s": body_timeout_s(sizes),
        }
        write_report(args.json_path, figures, params, attacks=details)
    return 1 if not_refused or hurt else 0


if __name__ == "__main__":
    raise SystemExit(main())
