"""The kvmesh command's routing of words to parts."""

from __future__ import annotations

import pytest

from kvmesh import cli


def test_longest_registered_command_wins() -> None:
    assert cli._lookup(["bench", "indexer", "--quick"]) == (("bench", "indexer"), "indexer.bench")
    assert cli._lookup(["quickstart", "--instances", "4"]) == (
        ("quickstart",),
        "indexer.quickstart",
    )
    assert cli._lookup(["bench", "nothing"]) is None
    assert cli._lookup(["indexer", "serve"]) is None  # has its own parser
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
