"""The ``kvmesh`` command.

Subcommands: ``indexer serve`` (indexer/cli.py), ``quickstart``
(indexer/quickstart.py), ``bench indexer`` (indexer/bench.py) and ``version``.
Each part's module is imported only when its command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import kvmesh

#: ``kvmesh bench <part>`` -> module whose ``main(argv) -> int`` runs it.
BENCH_PARTS = {"indexer": "indexer.bench"}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvmesh``."""
    from indexer import cli as indexer_cli

    parser = argparse.ArgumentParser(
        prog="kvmesh", description="KV-cache indexing and routing for LLM serving fleets."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    indexer_cli.add_parser(sub)
    sub.add_parser(
        "quickstart",
        help="start an indexer, publish a trace, run matches (options after it are its own)",
        add_help=False,
    )
    bench = sub.add_parser("bench", help="benchmarks (options after the part are its own)")
    bench.add_argument("part", choices=sorted(BENCH_PARTS))
    sub.add_parser("version", help="print the kvmesh version")
    return parser


def _run_part(module_name: str, argv: list[str]) -> int:
    """Import ``module_name`` now and run its ``main(argv) -> int``."""
    module = importlib.import_module(module_name)
    return int(module.main(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvmesh`` console script; returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # quickstart and bench pass everything after their name to the part's own parser.
    if args_list[:1] == ["quickstart"]:
        return _run_part("indexer.quickstart", args_list[1:])
    if args_list[:1] == ["bench"] and len(args_list) >= 2 and args_list[1] in BENCH_PARTS:
        return _run_part(BENCH_PARTS[args_list[1]], args_list[2:])
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
