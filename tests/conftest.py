"""Fixtures shared by every test folder: a fake clock, a real Redis, index factories."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest


class FakeClock:
    """A settable clock in seconds, passed to backends as ``clock``."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Any]:
    """A real redis-server on a free port, for the whole test session."""
    from lab.redisproc import RedisProcess

    with RedisProcess() as proc:
        yield proc


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Any]:
    """A real local 3-master Redis Cluster, for the whole test session."""
    from lab.redisproc import RedisClusterProcess

    with RedisClusterProcess() as proc:
        yield proc


BACKENDS = ["memory", "redis", "redis-cluster"]


@pytest.fixture(params=BACKENDS)
async def index(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[Any]:
    """Each backend in turn, empty, on the fake clock."""
    idx = make_index(request.param, clock, request)
    try:
        yield idx
    finally:
        await idx.close()


def make_index(backend: str, clock: FakeClock, request: pytest.FixtureRequest) -> Any:
    """A fresh, empty index of ``backend`` (a unique key prefix for Redis)."""
    if backend == "memory":
        from indexer.memory import MemoryIndex

        return MemoryIndex(clock=clock)
    from indexer.redis.backend import RedisIndex

    if backend == "redis-cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return RedisIndex(cluster.url, prefix=f"t{uuid.uuid4().hex[:8]}", clock=clock, cluster=True)
    server = request.getfixturevalue("redis_server")
    return RedisIndex(server.url, prefix=f"t{uuid.uuid4().hex[:8]}", clock=clock)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """No test may load protoc's compiler into the test process: it carries its own
    copy of protobuf's C++, and NIXL imported after it aborts the whole run
    (``munmap_chunk(): invalid pointer``). Run ``python -m grpc_tools.protoc`` in
    a child process instead."""
    import sys

    if "grpc_tools._protoc_compiler" in sys.modules:
        pytest.fail(
            f"{item.nodeid} loaded grpc_tools' protoc into the test process; run it in a "
            "child process (python -m grpc_tools.protoc)",
            pytrace=False,
        )


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    try:
        return float(item.config.getini("timeout") or 0)
    except (ValueError, TypeError):
        return 0.0


def _dump_tasks(nodeid: str) -> None:
    """Print the stack of every pending asyncio task (pytest-timeout prints only
    threads, and an async test that hangs shows just the loop's select)."""
    import asyncio
    import sys

    for _ in range(5):
        try:
            # every loop's tasks: the test's loop runs in this process's main thread
            # (a private WeakSet through 3.13; where it is gone, nothing is printed)
            every = list(getattr(asyncio.tasks, "_all_tasks", ()))
            tasks = [t for t in every if not t.done()]
            break
        except RuntimeError:  # the set changed while being copied
            continue
    else:
        return
    print(f"\n+++ {nodeid}: {len(tasks)} pending asyncio task(s) +++", file=sys.stderr)
    for t in tasks:
        lines = [f"task {t.get_name()}:"]
        try:  # the whole await chain (Task.print_stack shows its outer frame only)
            aw: Any = t.get_coro()
            while aw is not None and len(lines) < 40:
                frame = getattr(aw, "cr_frame", None) or getattr(aw, "ag_frame", None)
                if frame is not None:
                    code = frame.f_code
                    lines.append(f"  {code.co_filename}:{frame.f_lineno} {code.co_name}")
                aw = getattr(aw, "cr_await", None) or getattr(aw, "ag_await", None)
            if aw is not None:
                lines.append(f"  awaiting {aw!r}")
        except Exception as e:  # a task finishing as it is walked
            lines.append(f"  {e!r}")
        print("\n".join(lines), file=sys.stderr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Shortly before pytest-timeout ends a test, print what its asyncio tasks
    wait on, so a hang in CI names its line."""
    import threading

    timeout = _timeout_of(item)
    timer = None
    if timeout > 15:
        timer = threading.Timer(timeout - 5, _dump_tasks, args=(item.nodeid,))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
