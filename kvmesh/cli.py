"""The ``kvmesh`` command.

``indexer serve`` has its parser here (indexer/cli.py); every other command
is routed by :data:`COMMANDS` to a module whose ``main(argv) -> int`` parses
the rest of the line itself. Each part's module is imported only when its
command runs, so a part that is not installed costs the others nothing.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import kvmesh

#: Command words -> ("module" or "module:function" whose ``(argv) -> int`` runs
#: it with the words after the command, help line).
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("quickstart",): (
        "indexer.quickstart",
        "start an indexer, publish the trace, run matches",
    ),
    ("bench", "indexer"): ("indexer.bench", "indexer benchmark (memory and Redis)"),
    ("bench", "tee"): ("tee.bench", "tee benchmark (bounded fan-out vs serial)"),
    ("bench", "xfer"): ("xfer.bench", "KV transfer benchmark (NIXL and TCP)"),
    ("bench", "soak"): ("indexer.soak", "mixed-load soak of indexer replicas on Redis"),
    ("tee", "serve"): ("tee.cli", "run the request tee service"),
    ("cachesim", "serve"): ("tee.cachesim_cli:serve", "run the cache simulator service"),
    ("cachesim", "report"): ("tee.cachesim_cli:report", "print a cache simulator's report"),
    ("replay",): ("kvmesh.sim.replay", "replay a trace through routing policies"),
    ("up",): ("kvmesh.up", "run the whole cluster on this machine and drive it with the trace"),
    ("xfer", "serve"): ("xfer.cli", "run a KV transfer sidecar"),
    ("certs",): ("kvmesh.devcerts", "write a development CA, certificates and a policy"),
    ("token",): ("kvmesh.auth:token_main", "make a bearer token and the hash a policy lists"),
}

#: ``kvmesh bench <part>`` parts, for the help text.
BENCH_PARTS = sorted(words[1] for words in COMMANDS if words[0] == "bench")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvmesh``."""
    from indexer import cli as indexer_cli

    parser = argparse.ArgumentParser(
        prog="kvmesh", description="KV-cache indexing and routing for LLM serving fleets."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    indexer_cli.add_parser(sub)
    groups: dict[str, list[str]] = {}
    for words, (_, help_line) in COMMANDS.items():
        rest = " ".join(words[1:])
        groups.setdefault(words[0], []).append(f"{rest}: {help_line}" if rest else help_line)
    for first, lines in groups.items():
        if first == "indexer":
            continue
        sub.add_parser(first, help="; ".join(lines), add_help=False)
    sub.add_parser("version", help="print the kvmesh version")
    return parser


def _lookup(args: list[str]) -> tuple[tuple[str, ...], str] | None:
    """The longest registered command that ``args`` starts with, and its module."""
    for n in (2, 1):
        words = tuple(args[:n])
        if len(words) == n and words in COMMANDS:
            return words, COMMANDS[words][0]
    return None


def _run_part(target: str, argv: list[str]) -> int:
    """Import ``module[:function]`` now and run it (``main`` by default) on ``argv``."""
    module_name, _, func = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"kvmesh: {module_name} is not part of this build", file=sys.stderr)
            return 2
        raise
    return int(getattr(module, func or "main")(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvmesh`` console script; returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Registered commands pass everything after their words to the part's own parser.
    found = _lookup(args_list)
    if found is not None:
        words, target = found
        return _run_part(target, args_list[len(words) :])
    args = parser.parse_args(args_list)
    if args.command == "version":
        print(f"kvmesh {kvmesh.__version__}")
        return 0
    if args.command == "indexer":
        from indexer import cli as indexer_cli

        return indexer_cli.run(args)
    parser.error(f"unknown command {args.command}")  # pragma: no cover - argparse guards
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
