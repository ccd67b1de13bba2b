"""The Redis backend's Lua scripts: loading them, and tracing the commands that run them.

Each script in ``lua/`` is sent with ``lib.lua`` prepended; in cluster mode
the library runs with ``CLUSTER = true``, every script may touch several
slots of its node, and the control scripts also report a bumped generation.
Key schema and script protocol: indexer/redis/KEYS.md.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace

__all__ = [
    "CLUSTER_CONTROL",
    "CLUSTER_DATA",
    "CLUSTER_PREDICT",
    "DB_ATTRS",
    "LUA_DIR",
    "SCRIPTS",
    "TRACER_NAME",
    "Script",
    "load_scripts",
    "traced_exec",
]

#: The folder of the backend's Lua scripts.
LUA_DIR = Path(__file__).with_name("lua")
#: Scripts of a single-node Redis.
SCRIPTS = (
    "match",
    "apply",
    "register",
    "heartbeat",
    "remove",
    "purge",
    "snapshot",
    "predict",
    "pmatch",
    "wstart",
    "wread",
)
#: Cluster mode: scripts on the control slot (they report a bumped generation).
CLUSTER_CONTROL = (
    "register",
    "heartbeat",
    "remove",
    "snapshot",
    "capply",
    "cpurge",
    "wstart",
    "wread",
)
#: Cluster mode: scripts on a data node.
CLUSTER_DATA = ("match", "cblocks", "cgen")
#: Cluster mode: route-time predictions, on the control slot (they bump nothing).
CLUSTER_PREDICT = ("predict", "pmatch")

#: Cluster mode: every script may touch several slots of the node it runs on
#: (a Match reads the node's copies of the shallow blocks and the anchor's slot).
_CLUSTER_SHEBANG = "#!lua flags=allow-cross-slot-keys\n"

#: Tracer of Redis client spans (children of the ``index.*`` spans).
TRACER_NAME = "kvmesh.indexer.redis"
#: Attributes of every Redis client span (OpenTelemetry database conventions,
#: old and new names). Never key names, arguments or values: block keys are
#: derived from prompts.
DB_ATTRS: dict[str, str] = {"db.system": "redis", "db.system.name": "redis"}


class Script:
    """A Lua script (lib.lua + body) and its SHA1, loaded on NOSCRIPT."""

    __slots__ = ("name", "sha", "text")

    def __init__(self, name: str, lib: str, cluster: bool = False) -> None:
        body = (LUA_DIR / f"{name}.lua").read_text("utf-8")
        self.name = name
        if not cluster:
            self.text = lib + "\n" + body
        else:
            lib = lib.replace("local CLUSTER = false", "local CLUSTER = true")
            if name in CLUSTER_CONTROL:
                # Report a bumped generation: {reply, new generation or nil}.
                body = f"local reply = (function()\n{body}\nend)()\nreturn {{reply, bumped}}\n"
            self.text = _CLUSTER_SHEBANG + lib + "\n" + body
        self.sha = hashlib.sha1(self.text.encode("utf-8"), usedforsecurity=False).hexdigest()


def load_scripts(cluster: bool = False) -> dict[str, Script]:
    """Every script of a single-node Redis, or of a cluster, by name."""
    lib = (LUA_DIR / "lib.lua").read_text("utf-8")
    names = CLUSTER_CONTROL + CLUSTER_DATA + CLUSTER_PREDICT if cluster else SCRIPTS
    return {name: Script(name, lib, cluster) for name in names}


def traced_exec(
    exec_: Callable[..., Awaitable[Any]],
    tracer: trace.Tracer,
    url: str,
    scripts: Iterable[Script],
) -> Callable[..., Awaitable[Any]]:
    """``exec_`` with a CLIENT span per Redis command, named after the command."""
    parts = urlsplit(url)
    base: dict[str, Any] = {**DB_ATTRS, "server.address": parts.hostname or ""}
    with contextlib.suppress(ValueError):
        base["server.port"] = parts.port or 6379
    # EVALSHA names a script by its SHA1; the span says which of ours it is.
    names = {s.sha: s.name for s in scripts}

    async def traced(*args: Any, **kwargs: Any) -> Any:
        op = str(args[0]) if args else "command"
        attrs = {**base, "db.operation.name": op}
        if op == "EVALSHA" and len(args) > 1:
            attrs["kvmesh.redis.script"] = names.get(args[1], "unknown")
        with tracer.start_as_current_span(op, kind=trace.SpanKind.CLIENT, attributes=attrs):
            return await exec_(*args, **kwargs)

    return traced
