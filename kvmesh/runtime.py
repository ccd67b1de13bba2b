"""Process plumbing shared by every kvmesh service: event loop, logging, addresses, signals."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop when uvloop is installed, else the default one."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships on Linux and macOS
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": record.created,
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str, fmt: str) -> None:
    """Configure root logging to stderr (``fmt``: text or json)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets (``[::1]:50051``)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


class Stoppable(Protocol):
    """A started server: ``stop()`` drains and closes it."""

    async def stop(self) -> object:
        """Drain in-flight work and close (each service bounds how long); any result is ignored."""


S = TypeVar("S", bound=Stoppable)


async def wait_for_signal() -> None:
    """Return when the process gets SIGTERM or SIGINT (handlers removed on return)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def freeze_startup_objects() -> None:
    """Take every object alive once a server has started out of the garbage
    collector's reach (``gc.freeze``, after one collection): the modules,
    functions, types and descriptors of the import (about 80 k tracked objects
    in an indexer replica) are never garbage, yet a full collection walked every
    one of them, 10 ms on an idle core here and 30 to 50 ms while the replica
    ingests, with every call and health check waiting. A full collection then
    walks what the server made since. (What the start held and later drops into
    a reference cycle is never collected: bounded by what the start held.)"""
    gc.collect()
    gc.freeze()


async def serve_until_signal(
    start: Callable[[], Awaitable[S]],
    *,
    errors: tuple[type[BaseException], ...],
    log: logging.Logger,
    draining: str = "",
    ready: Callable[[S], None] | None = None,
) -> int:
    """Start a server, serve until SIGTERM or SIGINT, then stop it; return an exit code.

    A start failure of a type in ``errors`` (a port in use, bad settings, a
    backend refusing credentials) is one ``cannot start:`` log line and exit
    code 1, never a traceback. ``draining`` is logged when the signal comes;
    ``ready`` is called with the started server.
    """
    try:
        server = await start()
    except errors as e:
        log.error("cannot start: %s", e)
        return 1
    if ready is not None:
        ready(server)
    freeze_startup_objects()
    await wait_for_signal()
    if draining:
        log.info("signal received: %s", draining)
    await server.stop()
    return 0


def run_main(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run ``main()`` on a new :func:`new_event_loop` loop; return its exit code."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main())
