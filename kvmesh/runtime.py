"""Process plumbing shared by every kvmesh service: event loop, logging, status codes."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import grpc

#: Trailing metadata key carrying the offending field of an error.
ERROR_FIELD_METADATA = "kvmesh-error-field"


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


def status_code(name: str) -> grpc.StatusCode:
    """The grpc.StatusCode an error's code names (INTERNAL for UNKNOWN, OK or a bad name).

    Services' errors carry the *name* of their status so that their logic needs
    no grpc import; every server maps it here, so no call ever ends UNKNOWN.
    """
    code = getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK):
        return grpc.StatusCode.INTERNAL
    return code


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets (``[::1]:50051``)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"
