"""What a Prometheus scrape of each running component gets, and the guard that docs/api.md
documents all of it.

The indexer (with an engine event endpoint, so that its ZMQ counters exist),
the tee, the cache simulator and an xfer sidecar run in this process on free
127.0.0.1 ports and are scraped over HTTP as Prometheus scrapes them, in the
text format and in OpenMetrics: each exposes the ``process_*`` and
``python_*`` families and ``kvmesh_build_info{version}`` = 1, and no
``_created`` series (which prometheus_client itself would add, as the control
shows). Every ``kvmesh_*`` family a scrape shows, and each of the router
client's, is named in docs/api.md's metrics table, and every name that table
lists for these components is exposed by one of them.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import urllib.request
from pathlib import Path

import grpc
import grpc.aio
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

import kvmesh
from indexer.memory import MemoryIndex
from indexer.redis.backend import RedisIndex
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.tee.v1 import tee_pb2 as tee_pb
from kvmesh.api.tee.v1 import tee_pb2_grpc as tee_pb_grpc
from lab.bench.testsink import TestSink
from lab.redisproc import RedisProcess, free_port
from router_client.metrics import RouterMetrics
from tee.cachesim.config import CacheSimConfig
from tee.cachesim.server import CacheSimServer
from tee.config import TeeConfig
from tee.server import TeeServer
from tests.grpc.conftest import BLOCK, MODEL, close_harness, make_config, open_harness, register
from xfer.config import PoolSettings, XferConfig
from xfer.server import start_server as start_xfer

ROOT = Path(__file__).resolve().parents[2]
API_DOC = ROOT / "docs" / "api.md"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"

#: Families of the standard collectors every component must expose.
STANDARD = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_open_fds",
    "python_info",
    "python_gc_collections_total",
)


def _scrape(url: str, accept: str | None = None) -> str:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return str(resp.read().decode())


def families(text: str) -> dict[str, str]:
    """Family name -> type, from the ``# TYPE`` lines of an exposition."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))


def sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] not in "#"}


@pytest.fixture(scope="module")
def scrapes() -> dict[str, dict[str, str]]:
    """Component -> {"text": exposition, "openmetrics": exposition}, after some traffic."""
    return asyncio.run(_run_and_scrape())


async def _run_and_scrape() -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    endpoint = {
        "worker_id": "engine-0",
        "model": MODEL,
        "address": "http://engine-0:8000",
        # Nobody publishes there: the subscriber waits, its counters exist.
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "topic": "kv",
    }
    ix_port = free_port()
    h = await open_harness(
        make_config(metrics_port=ix_port, engine_events={"endpoints": [endpoint]}), MemoryIndex()
    )
    try:
        await register(h.stub, "w0")
        await h.stub.Match(pb.MatchRequest(model=MODEL, token_ids=list(range(BLOCK))))
        out["indexer"] = await _both(f"http://127.0.0.1:{h.server.metrics_port}/metrics")
    finally:
        await close_harness(h)

    # A replica over Redis: the families of its copy for followers (KEYS.md, "Watching").
    with RedisProcess() as redis_proc:
        rix = RedisIndex(redis_proc.url, prefix="expo")
        h = await open_harness(make_config(metrics_port=free_port()), rix)
        try:
            await register(h.stub, "w0")
            out["indexer_redis"] = await _both(f"http://127.0.0.1:{h.server.metrics_port}/metrics")
        finally:
            await close_harness(h)
            await rix.close()

    sink = await TestSink().start()
    tee_cfg = TeeConfig.model_validate(
        {"port": 0, "metrics_port": free_port(), "sinks": [{"type": "http", "url": sink.url}]}
    )
    tee = await TeeServer(tee_cfg).start()
    try:
        async with grpc.aio.insecure_channel(tee.address) as ch:
            event = tee_pb.RoutedEvent(
                kind=tee_pb.EVENT_KIND_INGEST, model=MODEL, input_ids=[1, 2], request_id="r"
            )
            await tee_pb_grpc.TeeServiceStub(ch).OfferEvents(
                tee_pb.OfferEventsRequest(events=[event])
            )
        for _ in range(200):
            if sink.received:
                break
            await asyncio.sleep(0.01)
        out["tee"] = await _both(f"http://127.0.0.1:{tee.metrics_port}/metrics")
    finally:
        await tee.stop(0)
        await sink.stop()

    sim = await CacheSimServer(CacheSimConfig(http_port=0, grpc_port=0)).start()
    try:
        out["cachesim"] = await _both(f"http://127.0.0.1:{sim.http_port}/metrics")
    finally:
        await sim.stop(0)

    with tempfile.TemporaryDirectory() as tmp:
        pool = PoolSettings(
            path=str(Path(tmp) / "pool"),
            page_size=1024,
            page_count=16,
            aux_size=32,
            aux_count=2,
            create=True,
        )
        xfer_cfg = XferConfig(
            role="prefill", port=0, metrics_port=free_port(), transport="tcp", pool=pool
        )
        xfer = await start_xfer(xfer_cfg)
        try:
            out["xfer"] = await _both(f"http://127.0.0.1:{xfer.metrics_port}/metrics")
        finally:
            await xfer.stop(0)
    return out


async def _both(url: str) -> dict[str, str]:
    return {
        "text": await asyncio.to_thread(_scrape, url),
        "openmetrics": await asyncio.to_thread(_scrape, url, OPENMETRICS),
    }


COMPONENTS = ("indexer", "tee", "cachesim", "xfer")


@pytest.mark.parametrize("component", COMPONENTS)
def test_scrape_has_process_python_and_build_info(
    scrapes: dict[str, dict[str, str]], component: str
) -> None:
    text = scrapes[component]["text"]
    fams = families(text)
    for name in STANDARD:
        assert name in fams, f"{component} lacks {name}"
    assert fams["kvmesh_build_info"] == "gauge"
    assert f'kvmesh_build_info{{version="{kvmesh.__version__}"}} 1.0' in text.splitlines()


@pytest.mark.parametrize("fmt", ["text", "openmetrics"])
@pytest.mark.parametrize("component", COMPONENTS)
def test_scrape_has_no_created_series(
    scrapes: dict[str, dict[str, str]], component: str, fmt: str
) -> None:
    text = scrapes[component][fmt]
    if fmt == "openmetrics":
        assert text.rstrip().endswith("# EOF")  # the negotiated format really is OpenMetrics
    created = sorted(n for n in sample_names(text) | set(families(text)) if n.endswith("_created"))
    assert created == [], f"{component} exposes {created[:5]}"
    # ...while it does expose counters that would have them.
    assert "counter" in families(text).values()


def test_prometheus_client_alone_would_expose_created_series() -> None:
    """The control: the same kind of counter on a plain registry has a ``_created`` series."""
    registry = CollectorRegistry()
    Counter("kvmesh_control", "A counter.", registry=registry).inc()
    assert "kvmesh_control_created" in sample_names(generate_latest(registry).decode())


# -- docs/api.md -----------------------------------------------------------------------


def _metrics_section() -> str:
    text = API_DOC.read_text()
    start = text.index("\n## Metrics\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _documented() -> set[str]:
    """Every ``kvmesh_*`` name in the first column of the metrics tables."""
    names: set[str] = set()
    for line in _metrics_section().splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names |= set(re.findall(r"`(kvmesh_[a-z0-9_]+)`", first))
    return names


def _exposed(scrapes: dict[str, dict[str, str]]) -> dict[str, str]:
    """``kvmesh_*`` family -> the component that exposes it (the router client's included)."""
    out: dict[str, str] = {}
    for component, texts in scrapes.items():
        for name in families(texts["text"]):
            if name.startswith("kvmesh_"):
                out[name] = component
    registry = CollectorRegistry()
    RouterMetrics(registry)
    for name in families(generate_latest(registry).decode()):
        if name.startswith("kvmesh_") and not name.endswith("_created"):
            out[name] = "router_client"
    return out


def test_every_exposed_family_is_documented(scrapes: dict[str, dict[str, str]]) -> None:
    documented = _documented()
    missing = sorted(
        f"{name} ({c})" for name, c in _exposed(scrapes).items() if name not in documented
    )
    assert missing == [], "families missing from docs/api.md's metrics table:\n" + "\n".join(
        missing
    )


#: Prefixes of the families of the components scraped here (the reverse check's scope).
SCRAPED_PREFIXES = tuple(f"kvmesh_{c}_" for c in (*COMPONENTS, "router", "tracing"))


def test_every_documented_family_is_exposed(scrapes: dict[str, dict[str, str]]) -> None:
    listed = {n for n in _documented() if n.startswith(SCRAPED_PREFIXES)}
    stale = sorted(listed - set(_exposed(scrapes)))
    assert stale == [], "docs/api.md lists families no component exposes:\n" + "\n".join(stale)


def test_the_standard_families_are_documented() -> None:
    section = _metrics_section()
    for name in ("process_*", "python_*", "kvmesh_build_info"):
        assert f"`{name}`" in section, name
