"""The Node.js client (clients/node) against a real indexer: stubs from proto/ in another language.

Starts an indexer in-process on a free port (its own event loop on a thread),
installs the client's pinned packages with ``npm ci`` when node_modules is
missing, and runs ``node --test``: the block-key vectors, then register,
PublishEventsStream, Match by token ids and by keys computed in JavaScript, and
the INVALID_ARGUMENT field contract. Skipped when ``node`` (or ``npm``, for a
first install) is not on PATH.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from indexer.config import IndexerConfig
from indexer.server import IndexerServer, start_server

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "node"
BLOCK = 16


@pytest.fixture(scope="module")
def node_client() -> Path:
    """The client directory with its node_modules installed."""
    assert shutil.which("node") is not None, "node is not on PATH (the Node.js client needs 18+)"
    if not (CLIENT / "node_modules" / "@grpc" / "grpc-js").is_dir():
        npm = shutil.which("npm")
        assert npm is not None, "npm is not on PATH and clients/node/node_modules is missing"
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=CLIENT,
            check=True,
            timeout=300,
        )
    return CLIENT


@pytest.fixture(scope="module")
def indexer_address() -> Iterator[str]:
    """A memory-backed indexer on a free 127.0.0.1 port, served from its own thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="indexer", daemon=True)
    thread.start()
    config = IndexerConfig.model_validate(
        {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "block_size": BLOCK}
    )
    started: Future[IndexerServer] = asyncio.run_coroutine_threadsafe(start_server(config), loop)
    server = started.result(timeout=15)
    try:
        yield server.address
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()


def test_node_client_against_a_running_indexer(node_client: Path, indexer_address: str) -> None:
    env = dict(os.environ)
    env["KVMESH_INDEXER_ADDR"] = indexer_address
    env["KVMESH_INDEXER_BLOCK_SIZE"] = str(BLOCK)
    proc = subprocess.run(
        ["node", "--test", "test/"],
        cwd=node_client,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = out.splitlines()
    # The indexer tests ran (none skipped for a missing address) and all passed.
    assert "# fail 0" in lines, out
    assert "# skipped 0" in lines, out
    assert any(line.startswith("ok ") and "indexer: register" in line for line in lines), out
    assert any(line.startswith("ok ") and "INVALID_ARGUMENT names" in line for line in lines), out
    assert any(line.startswith("ok ") and "vector: extreme token ids" in line for line in lines)
