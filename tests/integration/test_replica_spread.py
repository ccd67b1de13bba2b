"""Matches spread over indexer replicas, and reach a replica added later.

Real indexer servers on loopback sharing one in-process index (as replicas
share one Redis), real gRPC channels, and each replica's share counted by the
replica itself (``GetStats.matches``, asked over a channel of its own).

- Three replicas behind one multi-address target (``ipv4:a,b,c``, built by the
  router client from a comma-separated ``indexer.target``): with round robin
  (the default) each replica answers a third of 600 Matches, within ±15%,
  whether the Matches go unary (one call each) or over ``match_streams``
  MatchStreams (one call per stream). The same run with ``pick_first``, which
  gRPC uses unless told otherwise, leaves the load on one replica: the check
  fails there, which is what it exists to catch.
- A replica added while a router is running, found through DNS (see
  :func:`test_a_replica_added_later_gets_matches_within_a_connection_age`).
- The Node.js client (clients/node) spreads its Matches the same way, and so does
  the tee's gRPC sink its events over cache simulator replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio
import pytest

from indexer.config import IndexerConfig
from indexer.memory import MemoryIndex
from indexer.server import IndexerServer, start_server
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.blockkeys import block_keys
from router_client import ConfigError, IndexerClient, IndexerClientSettings, MatchStatus
from router_client.config import parse_config
from tee.cachesim.config import CacheSimConfig
from tee.cachesim.server import CacheSimServer
from tee.errors import UnknownModel
from tee.events import ingest
from tee.logic import Tee
from tee.sinks import GrpcSink
from tests.grpc.conftest import BLOCK, MODEL, batch, publish, register, stored
from tests.integration.test_node_client import install_node_client

TOKENS = list(range(100, 100 + 4 * BLOCK))  # four full blocks
KEYS = block_keys(TOKENS, BLOCK, MODEL)
#: Matches of one measurement and the tolerance around an even share.
MATCHES = 600
TOLERANCE = 0.15
#: Deadline of a test Match: generous, so that a loaded machine's scheduling
#: shows up as latency, never as a Match that went nowhere.
DEADLINE_MS = 3000.0


def server_config(host: str = "127.0.0.1", port: int = 0, **limits: Any) -> IndexerConfig:
    """A replica's config: ``host:port`` (0: a free port), no metrics endpoint, block size 4."""
    return IndexerConfig.model_validate(
        {
            "host": host,
            "port": port,
            "metrics_port": 0,
            "block_size": BLOCK,
            "shutdown_grace_s": 0.5,
            "limits": limits,
        }
    )


class Replicas:
    """Indexer replicas sharing one index, each with a channel of its own for GetStats."""

    def __init__(self) -> None:
        self.index = MemoryIndex()
        self.servers: list[IndexerServer] = []
        self._channels: list[grpc.aio.Channel] = []
        self.stubs: list[Any] = []

    async def add(self, config: IndexerConfig) -> IndexerServer:
        """Start one more replica of the shared index."""
        server = await start_server(config, self.index)
        self.servers.append(server)
        channel = grpc.aio.insecure_channel(server.address)
        self._channels.append(channel)
        self.stubs.append(pb_grpc.IndexerServiceStub(channel))
        return server

    async def seed(self) -> None:
        """Instance w0 holds the four blocks of TOKENS (published to the first replica)."""
        await register(self.stubs[0], "w0")
        await publish(self.stubs[0], batch(1, stored([11, 12, 13, 14], TOKENS)))

    async def matches(self) -> list[int]:
        """Matches each replica has answered since it started, by its own count."""
        stats = [await s.GetStats(pb.GetStatsRequest(), timeout=5) for s in self.stubs]
        return [int(st.matches) for st in stats]

    async def close(self) -> None:
        """Close the channels and stop every replica (the index stays)."""
        for channel in self._channels:
            await channel.close()
        for server in self.servers:
            await server.stop(0)
        self._channels.clear()
        self.servers.clear()
        self.stubs.clear()


@contextlib.asynccontextmanager
async def replicas() -> AsyncIterator[Replicas]:
    r = Replicas()
    try:
        yield r
    finally:
        await r.close()


async def match_all(client: IndexerClient, n: int, wave: int = 30) -> None:
    """``n`` Matches, ``wave`` at a time; every one answered with w0's four blocks."""
    for lo in range(0, n, wave):
        outs = await asyncio.gather(*(client.match(KEYS) for _ in range(min(wave, n - lo))))
        for out in outs:
            assert out.status is MatchStatus.OK, out.status
            assert out.matches["w0"].depth == 4


def deltas(after: Sequence[int], before: Sequence[int]) -> list[int]:
    return [a - b for a, b in zip(after, before, strict=True)]


def spread_evenly(counts: Sequence[int]) -> bool:
    """Whether every replica answered within ±TOLERANCE of an even share."""
    even = sum(counts) / len(counts)
    return all(abs(c - even) <= TOLERANCE * even for c in counts)


async def warm_up(client: IndexerClient, r: Replicas, *, every_replica: bool) -> None:
    """Matches until every replica has answered some (``every_replica``), then until the
    client's streams have all been placed again once more (each was placed while every
    replica's connection was up), within 10 s; else 30 Matches."""
    if not every_replica:
        await match_all(client, 30)
        return
    give_up = time.monotonic() + 10
    while min(await r.matches()) == 0:
        assert time.monotonic() < give_up, f"a replica never got a Match: {await r.matches()}"
        await match_all(client, 30)
    if client.settings.match_stream:
        rotated = client.streams_rotated + client.settings.match_streams
        while client.streams_rotated < rotated:
            assert time.monotonic() < give_up, "the streams did not rotate"
            await match_all(client, 30)
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("transport", ["unary", "streams"])
@pytest.mark.parametrize("policy", ["round_robin", "pick_first"])
async def test_matches_spread_over_three_replicas(policy: str, transport: str) -> None:
    """600 Matches through one router client whose target lists three replicas.

    Round robin places each call on the next ready replica: a unary Match is a
    call, and so is each of the client's three MatchStreams (rotated every
    0.2 s here, so that streams placed before every connection was up move).
    """
    async with replicas() as r:
        for _ in range(3):
            await r.add(server_config())
        await r.seed()
        settings = IndexerClientSettings(
            target=",".join(s.address for s in r.servers),
            load_balancing=policy,  # type: ignore[arg-type]
            deadline_ms=DEADLINE_MS,
            match_stream=transport == "streams",
            match_streams=3,
            match_stream_max_age_s=0.2,
        )
        client = IndexerClient(settings=settings, model=MODEL)
        try:
            await warm_up(client, r, every_replica=policy == "round_robin")
            before = await r.matches()
            await match_all(client, MATCHES)
            got = deltas(await r.matches(), before)
        finally:
            await client.close()
    print(f"\n{policy}/{transport}: Matches per replica {got}")
    assert sum(got) == MATCHES
    if transport == "streams":
        assert client.unary_calls == 0
    if policy == "round_robin":
        assert spread_evenly(got), got
    else:
        # What routers saw before: one replica answers everything.
        assert max(got) == MATCHES and not spread_evenly(got), got


# -- a replica added later, through DNS ---------------------------------------------


class DnsZone(asyncio.DatagramProtocol):
    """An authoritative DNS server on a UDP port: A records of names, changeable live.

    What a headless Service is to Kubernetes' cluster DNS: one name, an A record
    per ready replica. It answers A queries for its names (TTL 0), AAAA queries
    with no record, anything else NXDOMAIN; ``queries`` counts the A queries.
    """

    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = records
        self.queries = 0
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        qid, flags, qdcount = struct.unpack(">HHH", data[:6])
        if qdcount != 1:
            return
        i, labels = 12, []
        while data[i]:
            n = data[i]
            labels.append(data[i + 1 : i + 1 + n].decode("ascii").lower())
            i += 1 + n
        qtype, _qclass = struct.unpack(">HH", data[i + 1 : i + 5])
        question = data[12 : i + 5]
        name = ".".join(labels)
        answers = []
        if name in self.records and qtype == 1:
            self.queries += 1
            for ip in self.records[name]:
                rdata = bytes(int(x) for x in ip.split("."))
                # A pointer to the question's name, type A, class IN, TTL 0.
                answers.append(b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 0, 4) + rdata)
        rcode = 0 if name in self.records else 3
        # QR, AA, the query's RD; no recursion offered.
        header = struct.pack(
            ">HHHHHH", qid, 0x8400 | (flags & 0x0100) | rcode, 1, len(answers), 0, 0
        )
        assert self._transport is not None
        self._transport.sendto(header + question + b"".join(answers), addr)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


@contextlib.asynccontextmanager
async def dns_zone(records: dict[str, list[str]]) -> AsyncIterator[tuple[DnsZone, int]]:
    """A :class:`DnsZone` on a free 127.0.0.1 UDP port: (zone, port)."""
    zone = DnsZone(records)
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: zone, local_addr=("127.0.0.1", 0)
    )
    try:
        yield zone, transport.get_extra_info("sockname")[1]
    finally:
        zone.close()


#: The replicas' name and their loopback addresses (all of 127.0.0.0/8 is
#: loopback on Linux): one port for all, as a Service's endpoints share theirs.
NAME = "indexer-headless.kvmesh.test"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
#: The replicas' limits.max_connection_age_s and its grace, short for the test.
AGE_S = 1.0
GRACE_S = 1.0
#: The client's match_stream_max_age_s: below the grace, as by default.
STREAM_AGE_S = 0.5
#: How long the control run (connections never age) watches the late replica.
CONTROL_WINDOW_S = 3.0


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


async def start_on_one_port(
    r: Replicas, hosts: Sequence[str], later: Sequence[str], **limits: Any
) -> int:
    """Start a replica on each of ``hosts``, all on one free port that is free on the
    ``later`` hosts too; return the port."""
    for _attempt in range(5):
        first = await r.add(server_config(hosts[0], 0, **limits))
        try:
            for host in hosts[1:]:
                await r.add(server_config(host, first.port, **limits))
            if all(port_free(host, first.port) for host in later):
                return first.port
        except OSError:
            pass
        await r.close()  # the port is taken on one of the other addresses: another
    raise AssertionError("no port free on every loopback address")


async def drive(client: IndexerClient, stop: asyncio.Event) -> None:
    """A router's steady trickle of Matches until ``stop``."""
    while not stop.is_set():
        await match_all(client, 12, wave=12)
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("age_s", [AGE_S, 0.0], ids=["connection-age", "no-connection-age"])
async def test_a_replica_added_later_gets_matches_within_a_connection_age(age_s: float) -> None:
    """A third replica starts while a router client sends Matches to two; it is found
    through DNS within about one connection age.

    How it is found, as on Kubernetes with a headless Service: the client's target
    is ``dns://<server>/name:port``, resolved by gRPC's own DNS resolver (c-ares,
    which takes the DNS server from the target's authority) against a real DNS
    server on a UDP port (:class:`DnsZone`) whose A records list the ready
    replicas, and the replicas listen on 127.0.0.2-4, one port. Nothing global is
    touched: no /etc/hosts entry, no resolver configuration. gRPC resolves a name
    again only when a connection ends, which the replicas' max connection age
    makes happen (GOAWAY, then the client reconnects and re-resolves, at most
    every 0.1 s here: ``grpc.dns_min_time_between_resolutions_ms``, 30 s by
    default). The client's streams then rotate (``match_stream_max_age_s``) onto
    the new replica.

    The control run gives the replicas no connection age: the client never
    resolves again, and the new replica gets no Match at all while the client
    keeps rotating its streams over the two it knows.
    """
    async with replicas() as r, dns_zone({NAME: HOSTS[:2]}) as (zone, dns_port):
        limits = {"max_connection_age_s": age_s, "max_connection_age_grace_s": GRACE_S}
        port = await start_on_one_port(r, HOSTS[:2], HOSTS[2:], **limits)
        await r.seed()
        settings = IndexerClientSettings(
            target=f"dns://127.0.0.1:{dns_port}/{NAME}:{port}",
            deadline_ms=DEADLINE_MS,
            match_streams=3,
            match_stream_max_age_s=STREAM_AGE_S,
        )
        client = IndexerClient(
            settings=settings,
            model=MODEL,
            channel_options=[("grpc.dns_min_time_between_resolutions_ms", 100)],
        )
        stop = asyncio.Event()
        load = asyncio.create_task(drive(client, stop))
        try:
            give_up = time.monotonic() + 10
            while min(await r.matches()) == 0:
                assert time.monotonic() < give_up, await r.matches()
                await asyncio.sleep(0.02)
            # The third replica comes up, then DNS lists it (it became ready).
            await r.add(server_config(HOSTS[2], port, **limits))
            zone.records[NAME] = list(HOSTS)
            t0 = time.monotonic()
            rotated0 = client.streams_rotated
            window = CONTROL_WINDOW_S if not age_s else 10.0
            late = 0
            while time.monotonic() - t0 < window:
                late = (await r.matches())[2]
                if late:
                    break
                await asyncio.sleep(0.02)
            waited = time.monotonic() - t0
            if not age_s:
                assert late == 0, late
                assert client.streams_rotated > rotated0  # streams moved, but only over two
                print(f"\nno connection age: the late replica got nothing in {waited:.1f} s")
                return
            assert late > 0, f"the late replica got no Match in {waited:.1f} s"
            # Gets its traffic within one age (jittered up to +10%), a re-resolution and
            # one stream rotation, plus scheduling slack.
            assert waited < AGE_S * 1.1 + STREAM_AGE_S + 1.0, waited
            # And then its share: Matches over a few ages, per replica.
            before = await r.matches()
            await asyncio.sleep(3 * AGE_S)
            shares = deltas(await r.matches(), before)
            print(
                f"\nlate replica: first Match {waited:.2f} s after it was listed; "
                f"then Matches per replica {shares}; DNS A queries {zone.queries}"
            )
            assert min(shares) > 0, shares
        finally:
            stop.set()
            await load
            await client.close()


# -- the Node.js client ---------------------------------------------------------------

#: Sends Matches of argv[3] (block keys, decimal strings) to the addresses in argv[1]
#: (JSON), with argv[4] as loadBalancing: 60 to warm up (every connection up), then,
#: after a line on stdin, argv[2] more; prints how many of those were answered.
NODE_SCRIPT = """
const readline = require('node:readline');
const { indexerClient } = require('.');
const [addresses, n, keys, policy] = [JSON.parse(process.argv[1]), Number(process.argv[2]),
  JSON.parse(process.argv[3]), process.argv[4]];
const client = indexerClient(addresses, { loadBalancing: policy });
async function matches(count) {
  let ok = 0;
  for (let lo = 0; lo < count; lo += 30) {
    const wave = [];
    for (let i = lo; i < Math.min(count, lo + 30); i++) {
      const req = { model: 'test/model', blockKeys: keys.map(BigInt) };
      wave.push(client.match(req, { deadlineMs: 5000 }));
    }
    for (const res of await Promise.all(wave)) if (res.matches.length === 1) ok += 1;
  }
  return ok;
}
(async () => {
  await matches(60);
  console.log('warm');
  const lines = readline.createInterface({ input: process.stdin });
  await new Promise((resolve) => lines.once('line', resolve));
  const ok = await matches(n);
  client.close();
  console.log(JSON.stringify({ ok }));
  process.exit(0);
})().catch((err) => { console.error(err); process.exit(1); });
"""


@pytest.mark.parametrize("policy", ["round_robin", "pick_first"])
async def test_node_client_spreads_matches_over_replicas(policy: str) -> None:
    """``indexerClient([a, b, c])``: one ``ipv4:`` target, round robin by default."""
    node_dir = install_node_client()
    async with replicas() as r:
        for _ in range(3):
            await r.add(server_config())
        await r.seed()
        wire = [str(k & ((1 << 64) - 1)) for k in KEYS]
        proc = await asyncio.create_subprocess_exec(
            "node",
            "-e",
            NODE_SCRIPT,
            json.dumps([s.address for s in r.servers]),
            str(MATCHES),
            json.dumps(wire),
            policy,
            cwd=node_dir,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            warm = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert warm == b"warm\n", warm
            before = await r.matches()
            proc.stdin.write(b"go\n")
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, err.decode()
        assert json.loads(out.decode().strip().splitlines()[-1]) == {"ok": MATCHES}
        got = deltas(await r.matches(), before)
    print(f"\nnode {policy}: Matches per replica {got}")
    assert sum(got) == MATCHES
    assert spread_evenly(got) == (policy == "round_robin"), got


# -- the tee's gRPC sink, and targets --------------------------------------------------


def sim_requests(sim: CacheSimServer) -> int:
    """Requests of model m the simulator was sent (0 when none)."""
    try:
        return int(sim.sim.report("m")["m"]["total"]["requests"])
    except UnknownModel:
        return 0


async def test_tee_grpc_sink_spreads_events_over_replicas() -> None:
    """A sink whose target lists three cache simulators sends each a third of the events
    (each simulator counts the requests it was sent)."""
    sims = []
    try:
        for _ in range(3):
            cfg = CacheSimConfig(http_port=0, grpc_port=0, block_size=BLOCK)
            sims.append(await CacheSimServer(cfg).start())
        sink = GrpcSink(",".join(sim.grpc_address for sim in sims), name="sims")
        tee = await Tee([sink], concurrency=4).start()
        try:
            for i in range(300):
                assert tee.offer(ingest("m", TOKENS, f"r{i}", worker="w0"))
            give_up = time.monotonic() + 20
            while sum(st.sent for st in tee.stats()) < 300:
                assert time.monotonic() < give_up, tee.stats()
                await asyncio.sleep(0.01)
        finally:
            await tee.close(1)
        got = [sim_requests(sim) for sim in sims]
    finally:
        for sim in sims:
            await sim.stop(0)
    print(f"\ntee sink: events per simulator {got}")
    assert sum(got) == 300 and spread_evenly(got), got


def test_a_target_listing_replicas_takes_ip_addresses_of_one_family() -> None:
    """``indexer.target``: a name needs dns:///; a list is checked when the config loads."""
    ok = parse_config({"indexer": {"target": " 10.0.0.5:50051, 10.0.0.6:50051 "}})
    assert ok.indexer.target == "10.0.0.5:50051, 10.0.0.6:50051"
    assert parse_config({"indexer": {"target": "dns:///ix.ns.svc:50051"}}).indexer.target
    for bad, words in (
        ("ix-0:50051,ix-1:50051", "dns:///name:port"),
        ("10.0.0.5:50051,[::1]:50051", "mixes IPv4 and IPv6"),
        ("10.0.0.5,10.0.0.6:50051", "not host:port"),
    ):
        with pytest.raises(ConfigError) as info:
            parse_config({"indexer": {"target": bad}})
        assert info.value.field == "indexer.target" and words in str(info.value), info.value
