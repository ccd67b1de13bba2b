"""Progress lines on stderr (kvmesh.progress) and which commands run under a heartbeat."""

from __future__ import annotations

import re
import time

import pytest

from kvmesh import cli, progress


def _lines(err: str, prog: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"{prog}: [")]


def test_a_phase_prints_at_once_and_the_heartbeat_repeats_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = ""
    with progress.heartbeat("kvmesh bench demo", every_s=0.05):
        progress.phase("memory: publishing 10 blocks")
        # The heartbeat thread wakes every ~12 ms; wait for a repeat, a few seconds at most.
        deadline = time.monotonic() + 5
        while len(_lines(err, "kvmesh bench demo")) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
            captured = capsys.readouterr()
            assert captured.out == ""  # stdout stays the command's report
            err += captured.err
    lines = _lines(err, "kvmesh bench demo")
    assert len(lines) >= 2, err
    assert all(line.endswith("] memory: publishing 10 blocks") for line in lines), err
    # Outside the heartbeat the name is back to the default.
    progress.phase("after")
    assert re.fullmatch(r"kvmesh: \[\d+ s\] after", capsys.readouterr().err.strip())


def test_lines_name_the_command_and_the_phase(capsys: pytest.CaptureFixture[str]) -> None:
    with progress.heartbeat("kvmesh replay", every_s=3600):
        progress.phase("p2c (3/5): 100 requests")
    [line] = _lines(capsys.readouterr().err, "kvmesh replay")
    assert re.fullmatch(r"kvmesh replay: \[0 s\] p2c \(3/5\): 100 requests", line)


def test_tick_prints_only_after_its_interval(capsys: pytest.CaptureFixture[str]) -> None:
    with progress.heartbeat("kvmesh replay", every_s=3600):
        progress.phase("start")
        progress.tick("too soon", every_s=3600)
        progress.tick(lambda: "due", every_s=0)
    lines = _lines(capsys.readouterr().err, "kvmesh replay")
    assert [line.split("] ", 1)[1] for line in lines] == ["start", "due"]


def test_benchmarks_and_the_replay_report_progress_servers_do_not() -> None:
    long_running = {words for words in cli.COMMANDS if cli.reports_progress(words)}
    assert {w for w in cli.COMMANDS if w[0] == "bench"} | {("replay",)} == long_running
    assert not cli.reports_progress(("indexer", "serve"))
    assert not cli.reports_progress(("up",))
