"""The Node.js client (clients/node) against a real indexer: generated TypeScript stubs.

Starts an indexer in-process on a free port (its own event loop on a thread),
installs the client's pinned packages with ``npm ci`` when node_modules lacks
them, builds the package (``npm run build``: tsc of src/ and the committed
protobuf-es stubs in src/gen/ to dist/) when dist/ is older than its sources,
and runs ``node --test``: the block-key vectors (and a wrong vector rejected),
the stubs' freshness against proto/, the packed file list and the unpacked
tarball, the declarations' types, then register, PublishEventsStream, Match by
token ids and by keys computed in JavaScript, the INVALID_ARGUMENT field
contract, and the standard error details decoded from ``grpc-status-details-bin``
(a field violation; a retry delay from a second indexer with a per-client Match
rate, :data:`LIMITED`).
Fails when ``node`` or ``npm`` is not on PATH. The same tests over mutual TLS
with an authorization policy, and the TLS tests: tests/security/test_node_tls.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from indexer.config import IndexerConfig
from indexer.server import IndexerServer, start_server

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "node"
BLOCK = 16
#: Config of the indexer at KVMESH_INDEXER_LIMITED_ADDR (clients/node/test/status.test.js):
#: one Match per 1000 s per client, so the second is refused with a retry delay.
LIMITED: dict[str, Any] = {"limits": {"per_client": {"match_rps": 0.001, "match_burst": 1}}}


#: Packages of clients/node/package.json whose absence from node_modules means ``npm ci``.
NODE_PACKAGES = ("@grpc/grpc-js", "@bufbuild/protobuf", "@node-rs/xxhash", "typescript")


def build_is_stale(client: Path) -> bool:
    """Whether ``client``/dist is missing or older than a source of the build."""
    built = client / "dist" / "index.js"
    if not built.exists():
        return True
    sources = [client / "package.json", client / "tsconfig.json", *(client / "src").rglob("*.ts")]
    return max(p.stat().st_mtime for p in sources) > built.stat().st_mtime


def install_node_client() -> Path:
    """The client directory, its node_modules installed and dist/ built (when missing or stale)."""
    assert shutil.which("node") is not None, "node is not on PATH (the Node.js client needs 18+)"
    npm = shutil.which("npm")
    assert npm is not None, "npm is not on PATH"
    if not all((CLIENT / "node_modules" / name).is_dir() for name in NODE_PACKAGES):
        # npm ci runs the package's `prepare` script: the build.
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=CLIENT,
            check=True,
            timeout=300,
        )
    if build_is_stale(CLIENT):
        subprocess.run([npm, "run", "--silent", "build"], cwd=CLIENT, check=True, timeout=300)
    return CLIENT


@contextlib.contextmanager
def serve_indexer(**overrides: Any) -> Iterator[str]:
    """A memory-backed indexer on a free 127.0.0.1 port, served from its own thread.

    ``overrides`` are config keys (``tls``, ``auth``...); yields its address.
    """
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="indexer", daemon=True)
    thread.start()
    config = IndexerConfig.model_validate(
        {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "block_size": BLOCK, **overrides}
    )
    try:
        started: Future[IndexerServer] = asyncio.run_coroutine_threadsafe(
            start_server(config), loop
        )
        server = started.result(timeout=15)
        try:
            yield server.address
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=15)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()


def run_node_tests(client: Path, env: dict[str, str]) -> list[str]:
    """``node --test test/`` with ``env`` added; asserts it passed, returns the TAP lines."""
    proc = subprocess.run(
        ["node", "--test", "test/"],
        cwd=client,
        env={**os.environ, "KVMESH_INDEXER_BLOCK_SIZE": str(BLOCK), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = out.splitlines()
    assert "# fail 0" in lines, out
    return lines


def passed(lines: list[str], name: str) -> bool:
    """Whether the TAP ``lines`` report the test ``name`` as passed, not skipped."""
    return any(
        line.lstrip().startswith("ok ") and name in line and "# SKIP" not in line for line in lines
    )


@pytest.fixture(scope="module")
def node_client() -> Path:
    """The client directory with its node_modules installed."""
    return install_node_client()


@pytest.fixture(scope="module")
def indexer_address() -> Iterator[str]:
    """A plaintext indexer without an authorization policy."""
    with serve_indexer() as address:
        yield address


@pytest.fixture(scope="module")
def limited_address() -> Iterator[str]:
    """A plaintext indexer with a per-client Match rate (:data:`LIMITED`)."""
    with serve_indexer(**LIMITED) as address:
        yield address


def test_node_client_against_a_running_indexer(
    node_client: Path, indexer_address: str, limited_address: str
) -> None:
    lines = run_node_tests(
        node_client,
        {"KVMESH_INDEXER_ADDR": indexer_address, "KVMESH_INDEXER_LIMITED_ADDR": limited_address},
    )
    out = "\n".join(lines)
    # The indexer tests ran (none skipped for a missing address) and all passed; only the
    # TLS tests, which need the test PKI (tests/security/test_node_tls.py), are skipped.
    skipped = [line for line in lines if "# SKIP" in line]
    assert skipped and all("tls: " in line for line in skipped), out
    assert passed(lines, "indexer: register"), out
    assert passed(lines, "INVALID_ARGUMENT names"), out
    assert passed(lines, "vector: extreme token ids"), out
    assert passed(lines, "a wrong vector is rejected"), out
    assert passed(lines, "gen: src/gen is what buf.gen.node.yaml generates"), out
    assert passed(lines, "gen: the check reports a changed, a missing and an extra file"), out
    assert passed(lines, "pack: the file list holds the generated stubs"), out
    assert passed(lines, "pack: the tarball, unpacked in another folder"), out
    assert passed(lines, "types: the client is typed by the generated messages"), out
    assert passed(lines, "status: INVALID_ARGUMENT carries a google.rpc.BadRequest"), out
    assert passed(lines, "status: a rate refusal carries a google.rpc.RetryInfo"), out
