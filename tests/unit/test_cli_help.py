"""What a person reads from the kvmesh command: every ``--help``, bad flags, ``--version``.

Each command of :data:`kvmesh.cli.COMMANDS` (and each mode of ``kvmesh bench
indexer``) runs ``--help`` in-process; the parser that printed it is caught so
that every option's default can be checked against the text.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvmesh
from indexer.config import IndexerConfig
from kvmesh import cli
from kvmesh.clihelp import plain
from tee.cachesim.config import CacheSimConfig
from tee.config import TeeConfig
from xfer.config import PoolSettings, XferConfig

#: Every command line whose help a person may ask for: the table's commands and the
#: benchmarks ``kvmesh bench indexer`` runs instead with a mode flag.
COMMAND_LINES = [
    *(list(words) for words in cli.COMMANDS),
    ["bench", "indexer", "--floor"],
    ["bench", "indexer", "--tls"],
    ["bench", "indexer", "--matchstream"],
]


def _name(line: list[str]) -> str:
    return " ".join(line)


@pytest.fixture
def printed_parsers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[argparse.ArgumentParser]]:
    """The parsers whose help was printed while the test ran."""
    seen: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.print_help

    def print_help(self: argparse.ArgumentParser, file: Any = None) -> None:
        seen.append(self)
        original(self, file)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", print_help)
    yield seen


def run_help(line: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``kvmesh <line> --help``, in-process: its output (it must exit 0)."""
    with pytest.raises(SystemExit) as e:
        cli.main([*line, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    return out


def option_block(help_text: str, action: argparse.Action) -> str:
    """The lines of ``help_text`` that describe ``action``, whitespace collapsed."""
    lines = help_text.splitlines()
    first = action.option_strings[0]
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if line.startswith("  ") and re.match(rf"{re.escape(first)}\b(?!-)", stripped):
            block = [stripped]
            for nxt in lines[i + 1 :]:
                if not nxt.strip() or nxt.startswith("  -"):  # the next option, or the end
                    break
                block.append(nxt.strip())
            return " ".join(" ".join(block).split())
    raise AssertionError(f"{first} is not in the help:\n{help_text}")


def _shows(block: str, value: Any) -> bool:
    if isinstance(value, list | tuple):
        return all(_shows(block, v) for v in value)
    if isinstance(value, float):
        return f"{value:g}" in block or str(value) in block
    return str(value) in block


def _takes_no_value(action: argparse.Action) -> bool:
    return action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)


@pytest.mark.parametrize("line", COMMAND_LINES, ids=_name)
def test_help_shows_every_default_and_no_rest_markup(
    line: list[str],
    capsys: pytest.CaptureFixture[str],
    printed_parsers: list[argparse.ArgumentParser],
) -> None:
    out = run_help(line, capsys)
    words = [w for w in line if not w.startswith("-")]
    assert out.startswith(f"usage: kvmesh {' '.join(words)}"), out[:200]
    # reST literals and roles, and any other backquote, read as noise in a terminal.
    assert "`" not in out, out
    assert not re.search(r":(class|func|mod|data|meth|attr):", out), out
    [parser] = printed_parsers
    # Servers' flags default to None (a config setting's default applies): see below.
    for action in parser._actions:
        if (
            not action.option_strings
            or action.help == argparse.SUPPRESS
            or isinstance(action, argparse._HelpAction | argparse._VersionAction)
            or action.default is None
            or action.default is argparse.SUPPRESS
            or _takes_no_value(action)
        ):
            continue
        block = option_block(out, action)
        assert "default" in block, f"{action.option_strings[0]}: {block}"
        if action.default != "":
            assert _shows(block, action.default), f"{action.option_strings[0]}: {block}"


#: Service flags whose help must show the default of the config setting they override.
CONFIG_DEFAULTS = [
    (["indexer", "serve"], "--port", IndexerConfig().port),
    (["indexer", "serve"], "--metrics-port", IndexerConfig().metrics_port),
    (["indexer", "serve"], "--block-size", IndexerConfig().block_size),
    (["indexer", "serve"], "--redis-prefix", IndexerConfig().redis.prefix),
    (["indexer", "serve"], "--max-match-blocks", IndexerConfig().limits.max_match_blocks),
    (["indexer", "serve"], "--shutdown-grace", IndexerConfig().shutdown_grace_s),
    (["indexer", "serve"], "--log-level", IndexerConfig().log_level),
    (["tee", "serve"], "--port", TeeConfig().port),
    (["tee", "serve"], "--send-concurrency", TeeConfig().send_concurrency),
    (["tee", "serve"], "--queue-size", TeeConfig().queue_size),
    (["tee", "serve"], "--shutdown-deadline", TeeConfig().shutdown_deadline_s),
    (["cachesim", "serve"], "--http-port", CacheSimConfig().http_port),
    (["cachesim", "serve"], "--grpc-port", CacheSimConfig().grpc_port),
    (["cachesim", "serve"], "--worker-capacity", CacheSimConfig().worker_capacity_blocks),
    (["cachesim", "serve"], "--window", CacheSimConfig().window_s),
    (["xfer", "serve"], "--port", XferConfig.model_fields["port"].default),
    (["xfer", "serve"], "--queues", XferConfig.model_fields["queues"].default),
    (
        ["xfer", "serve"],
        "--heartbeat-interval-s",
        XferConfig.model_fields["heartbeat_interval_s"].default,
    ),
    (["xfer", "serve"], "--aux-size", PoolSettings.model_fields["aux_size"].default),
]


@pytest.mark.parametrize(
    ("line", "flag", "default"), CONFIG_DEFAULTS, ids=lambda v: v if isinstance(v, str) else ""
)
def test_service_flags_show_their_config_default(
    line: list[str],
    flag: str,
    default: Any,
    capsys: pytest.CaptureFixture[str],
    printed_parsers: list[argparse.ArgumentParser],
) -> None:
    out = run_help(line, capsys)
    [parser] = printed_parsers
    [action] = [a for a in parser._actions if flag in a.option_strings]
    block = option_block(out, action)
    assert "(default: " in block and _shows(block, default), block


@pytest.mark.parametrize("line", COMMAND_LINES, ids=_name)
def test_a_wrong_flag_prints_the_commands_usage(
    line: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([*line, "--no-such-flag"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    words = [w for w in line if not w.startswith("-")]
    assert err.startswith(f"usage: kvmesh {' '.join(words)}"), err[:300]
    assert "--no-such-flag" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvmesh {kvmesh.__version__}"


def test_rest_markup_reads_as_plain_text() -> None:
    assert plain("``kvmesh tee serve``: run it") == "kvmesh tee serve: run it"
    assert plain("see :class:`router_client.Router` and :func:`~kvmesh.cli.main`") == (
        "see router_client.Router and main"
    )
    assert plain(":mod:`lab.sim.engine` engines") == "lab.sim.engine engines"


def test_plot_without_matplotlib_fails_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lab.sim import replay

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    png = tmp_path / "replay.png"
    assert replay.main(["--plot", str(png), "--limit", "50"]) == 2
    captured = capsys.readouterr()
    assert "--plot needs matplotlib" in captured.err
    assert "kvmesh[replay]" in captured.err
    # Nothing ran: no table, no file.
    assert captured.out == "" and not png.exists()
