"""The kvmesh command's routing of words to parts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmesh import cli


def test_longest_registered_command_wins() -> None:
    assert cli._lookup(["bench", "indexer", "--quick"]) == (
        ("bench", "indexer"),
        "lab.bench.indexer",
    )
    assert cli._lookup(["quickstart", "--instances", "4"]) == (
        ("quickstart",),
        "lab.quickstart",
    )
    assert cli._lookup(["bench", "nothing"]) is None
    assert cli._lookup(["indexer", "serve", "--port", "0"]) == (("indexer", "serve"), "indexer.cli")
    assert cli._lookup([]) is None


def test_every_registered_target_names_a_module_and_function() -> None:
    for words, (target, help_line) in cli.COMMANDS.items():
        module, _, func = target.partition(":")
        assert module and all(part.isidentifier() for part in module.split("."))
        assert not func or func.isidentifier()
        assert words and help_line


def test_version_and_bad_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["version"]) == 0
    assert "kvmesh" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["no-such-command"])
    assert e.value.code == 2


def test_part_runs_with_the_rest_of_the_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "indexer", "--help"])
    assert e.value.code == 0
    assert "--json" in capsys.readouterr().out


def test_help_lists_every_command_of_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for words, (_, help_line) in cli.COMMANDS.items():
        assert words[0] in out
        assert " ".join(help_line.split()) in out, words
    assert "version" in out


def test_indexer_serve_runs_through_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["indexer", "serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvmesh indexer serve")
    for flag in ("--config", "--backend", "--zmq-endpoint", "--no-sglang-api", "--health-port"):
        assert flag in out
    assert cli.main(["indexer", "serve", "--port", "7", "--print-config"]) == 0
    assert '"port": 7' in capsys.readouterr().out


@pytest.mark.parametrize("group", ["bench", "indexer", "tee", "xfer", "cachesim"])
def test_a_bare_group_word_lists_its_commands(
    group: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([group]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kvmesh {group} COMMAND")
    assert "unknown command" not in err
    for words, (_, help_line) in cli.COMMANDS.items():
        if words[0] == group:
            assert f"  {words[1]} " in err and help_line in err
    assert cli.main([group, "--help"]) == 0
    assert f"usage: kvmesh {group} COMMAND" in capsys.readouterr().out


def test_an_unknown_word_of_a_group_names_it_and_lists_the_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "nothing"]) == 2
    err = capsys.readouterr().err
    assert "kvmesh bench: unknown command 'nothing'" in err
    assert all(f"  {part} " in err for part in cli.BENCH_PARTS)


def test_the_command_imports_no_part_until_one_runs() -> None:
    code = (
        "import sys\n"
        "from kvmesh import cli\n"
        "cli.build_parser().format_help()\n"
        "parts = {'indexer', 'tee', 'xfer', 'router_client', 'lab'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in parts))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == "[]"
