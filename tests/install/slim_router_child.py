"""The child process of tests/install/test_slim_router.py: a router-only install, simulated.

Run as ``python slim_router_child.py SPEC.json``. Before anything else it may
install :class:`Blocker`, a ``sys.meta_path`` finder that refuses (ImportError
naming the module) every module of a distribution the router-only install does
not have, and every module the spec denies by name; then it runs the spec's
scenario and prints one JSON line: the scenario's answers, the modules of the
spec's ``forbidden`` list found in ``sys.modules`` and the imports the blocker
refused. A refused import nobody catches ends the process with a traceback
naming the module (exit status 1).

Only the standard library is imported here before the blocker is in place, so
the same file also runs unchanged in a real router-only environment.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import site
import sys
import sysconfig
from collections.abc import Sequence
from importlib import metadata
from types import ModuleType
from typing import Any


def _matches(name: str, prefixes: Sequence[str]) -> str | None:
    """The entry of ``prefixes`` that is ``name`` or a package above it."""
    for p in prefixes:
        if name == p or name.startswith(p + "."):
            return p
    return None


class Blocker(importlib.abc.MetaPathFinder):
    """Refuses the modules a router-only install would not have.

    A module is refused when its name falls under ``deny`` (and not under
    ``except_``), or when the file it would load from lies in site-packages
    but belongs to none of the ``allowed`` distributions (namespace packages
    such as ``google`` or ``opentelemetry`` are thus split by the files each
    distribution installs: ``google.protobuf`` loads, ``google.rpc`` does not).
    """

    def __init__(self, deny: Sequence[str], except_: Sequence[str], allowed: Sequence[str]) -> None:
        self.deny = tuple(deny)
        self.except_ = tuple(except_)
        self.refused: list[str] = []
        self._owner: dict[str, str] = {}
        allowed_keys = {_key(a) for a in allowed}
        self._allowed_files: set[str] = set()
        for dist in metadata.distributions():
            name = dist.metadata["Name"] or ""
            for f in dist.files or ():
                path = os.path.realpath(str(dist.locate_file(f)))
                if _key(name) in allowed_keys:
                    self._allowed_files.add(path)
                else:
                    self._owner.setdefault(path, name)
        paths = [
            *site.getsitepackages(),
            site.getusersitepackages(),
            sysconfig.get_paths()["purelib"],
        ]
        self._site = tuple(os.path.realpath(p) + os.sep for p in paths if p)

    def _refuse(self, name: str, why: str) -> ImportError:
        self.refused.append(name)
        return ImportError(f"No module named {name!r} in a router-only install ({why})", name=name)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        denied = _matches(fullname, self.deny)
        if denied is not None and _matches(fullname, self.except_) is None:
            raise self._refuse(fullname, f"{denied} is denied")
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or not spec.has_location or spec.origin is None:
            return spec
        origin = os.path.realpath(spec.origin)
        if origin.startswith(self._site) and origin not in self._allowed_files:
            owner = self._owner.get(origin, "no distribution")
            raise self._refuse(fullname, f"{origin} belongs to {owner}")
        return spec


def _key(name: str) -> str:
    """A distribution name normalised (PEP 503)."""
    return "-".join(name.lower().replace("_", "-").replace(".", "-").split("-"))


async def _route(spec: dict[str, Any]) -> dict[str, Any]:
    """What a router does: its config file, an IndexerClient, a Router, Matches."""
    from kvmesh.blockkeys import block_keys
    from router_client import IndexerClient, Router, RouteRequest, load_config

    config = load_config(spec["config"], environ={})
    tokens = spec["tokens"]
    keys = block_keys(tokens, spec["block_size"], config.model, config.lora_name)
    out: dict[str, Any] = {}
    for transport, stream in (("stream", True), ("unary", False)):
        settings = config.indexer.model_copy(update={"match_stream": stream})
        client = IndexerClient(settings=settings, model=config.model)
        try:
            outcome = await client.match(keys)
            router = Router(config, indexer=client, block_size=spec["block_size"], seed=0)
            decision = await router.route(
                RouteRequest(transport, len(tokens), token_ids=tokens), decode=False
            )
            out[transport] = {
                "status": outcome.status.value,
                "depths": {w: m.depth for w, m in sorted(outcome.matches.items())},
                "prefill": [decision.prefill.worker, decision.prefill.reason],
                "streams_opened": client.streams_opened,
                "unary_calls": client.unary_calls,
            }
        finally:
            await client.close()
    return out


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        spec = json.load(f)
    blocker = None
    if spec.get("blocker") is not None:
        b = spec["blocker"]
        blocker = Blocker(b["deny"], b.get("except", ()), b["allowed"])
        sys.meta_path.insert(0, blocker)
    result: dict[str, Any] = {}
    if spec["scenario"] == "route":
        result["route"] = asyncio.run(_route(spec))
    elif spec["scenario"] == "import":
        for name in spec["modules"]:
            importlib.import_module(name)
    elif spec["scenario"] == "exec":
        exec(compile(spec["source"], "<scenario>", "exec"), {"__name__": "__scenario__"})
    else:
        raise SystemExit(f"unknown scenario {spec['scenario']!r}")
    result["loaded"] = sorted(m for m in sys.modules if _matches(m, spec["forbidden"]))
    result["refused"] = sorted(set(blocker.refused)) if blocker is not None else []
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
