"""The engines' fork server (lab/engines/zygote.py) with a tiny program: children forked
from one import, each with its own pid, group and stdio, run at once, report their
exit codes, stop as stop_all stops children, and die with the harness."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.children import ChildExited, ChildProcess, stop_all
from lab.engines.zygote import Zygote

ROOT = Path(__file__).resolve().parents[2]

#: The program the zygote imports: it records the pid that imported it, so a
#: child can tell it was forked from that import rather than started afresh.
PROGRAM = """
import os, subprocess, sys, time

IMPORTED_BY = os.getpid()


def main(argv):
    mode = argv[0]
    if mode == "echo":
        print("READY", os.getpid(), os.getpgrp(), os.getsid(0), IMPORTED_BY,
              os.environ.get("ZYGOTE_TEST", "-"), flush=True)
        for line in sys.stdin:
            print(line.strip().upper(), flush=True)
        return 0
    if mode == "exit":
        print("going with", argv[1], file=sys.stderr, flush=True)
        return int(argv[1])
    if mode == "group":
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("READY", grandchild.pid, flush=True)
        time.sleep(600)
    raise SystemExit(f"unknown mode {mode}")
"""


def _gone(pid: int, timeout_s: float = 20.0) -> bool:
    """Whether ``pid`` ends (or is a zombie) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def program(tmp_path: Path) -> Iterator[tuple[Zygote, dict[str, str]]]:
    (tmp_path / "zygote_program.py").write_text(PROGRAM)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path)])
    zygote = Zygote(sys.executable, "zygote_program", env=env, log_path=tmp_path / "zygote.log")
    try:
        yield zygote, env
    finally:
        zygote.close()


def _child(zygote: Zygote, env: dict[str, str], log: Path, *args: str) -> ChildProcess:
    return ChildProcess(
        [sys.executable, "-m", "zygote_program", *args],
        env=env,
        log_path=log,
        pipes=True,
        die_with_parent=True,
        spawn=zygote.spawn,
    )


def test_two_children_of_one_import_run_at_once_with_their_own_stdio(
    program: tuple[Zygote, dict[str, str]], tmp_path: Path
) -> None:
    zygote, env = program
    a = _child(zygote, {**env, "ZYGOTE_TEST": "a"}, tmp_path / "a.log", "echo").start()
    b = _child(zygote, {**env, "ZYGOTE_TEST": "b"}, tmp_path / "b.log", "echo").start()
    try:
        assert zygote.ready["threads"] == ["MainThread"]
        seen = []
        for child, tag in ((a, "a"), (b, "b")):
            pid, pgid, sid, imported_by, env_tag = child.wait_line(30).split()
            assert int(pid) == child.pid == int(pgid) == int(sid)  # a session of its own
            assert int(imported_by) == zygote.pid  # forked after the zygote's import
            assert env_tag == tag  # the request's environment
            seen.append(int(pid))
        assert len(set(seen)) == 2 and zygote.pid not in seen
        b.send_line("to b")
        a.send_line("to a")
        assert (a.read_line(10), b.read_line(10)) == ("TO A", "TO B")
        assert a.alive() and b.alive()
        a.close_stdin()
        a.proc.wait(10)
        assert a.exit_code() == 0 and b.alive()
        b.send_line("still here")
        assert b.read_line(10) == "STILL HERE"
    finally:
        stop_all([a, b])
    assert b.exit_code() in (0, -signal.SIGTERM)


def test_a_child_exiting_non_zero_is_reported_with_its_log(
    program: tuple[Zygote, dict[str, str]], tmp_path: Path
) -> None:
    zygote, env = program
    child = _child(zygote, env, tmp_path / "exit.log", "exit", "3").start()
    with pytest.raises(ChildExited, match=r"exited with code 3 (.|\n)*going with 3"):
        child.wait_line(30)
    assert child.exit_code() == 3
    assert zygote.idle()


def test_kill_takes_the_childs_whole_group(
    program: tuple[Zygote, dict[str, str]], tmp_path: Path
) -> None:
    zygote, env = program
    child = _child(zygote, env, tmp_path / "group.log", "group").start()
    grandchild = int(child.wait_line(30))
    assert not zygote.idle()
    child.kill()
    assert child.exit_code() == -signal.SIGKILL
    assert _gone(grandchild)
    assert zygote.idle()


def test_children_die_with_the_harness(tmp_path: Path) -> None:
    """A harness killed by SIGKILL leaves neither its zygote nor the zygote's children."""
    (tmp_path / "zygote_program.py").write_text(PROGRAM)
    harness = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        from lab.engines.zygote import Zygote
        env = dict(os.environ, PYTHONPATH={os.pathsep.join([str(ROOT), str(tmp_path)])!r})
        z = Zygote(sys.executable, "zygote_program", env=env)
        c = z.spawn([sys.executable, "-m", "zygote_program", "group"], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, env=env)
        grandchild = c.stdout.readline().decode().split()[1]
        print(z.pid, c.pid, grandchild, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", harness],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert proc.stdout is not None
        zygote_pid, child_pid, grandchild = (int(w) for w in proc.stdout.readline().split())
        assert not _gone(child_pid, 0.5) and not _gone(zygote_pid, 0.1)
        proc.kill()
        proc.wait()
        assert _gone(zygote_pid)
        assert _gone(child_pid)
        assert _gone(grandchild)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_closed_zygote_stops_its_children_and_refuses_more(
    program: tuple[Zygote, dict[str, str]], tmp_path: Path
) -> None:
    zygote, env = program
    child = _child(zygote, env, tmp_path / "c.log", "group").start()
    grandchild = int(child.wait_line(30))
    zygote.close()
    assert child.proc.wait(20) == -signal.SIGTERM
    assert _gone(grandchild)
    assert zygote.ended()
    with pytest.raises(RuntimeError, match="closed"):
        _child(zygote, env, tmp_path / "d.log", "echo").start()
    with pytest.raises(ValueError, match="this zygote runs"):
        zygote.spawn([sys.executable, "-m", "another_program"])


def test_the_harness_forks_engines_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVMESH_CONFORMANCE_ZYGOTE=0`` starts engines as processes of their own; otherwise
    the conformance harness shares one lazily started zygote per interpreter and program."""
    from lab.conformance import _ZYGOTES, VLLM, ZYGOTE_ENV, engine_spawn

    python = Path(sys.executable)
    monkeypatch.setenv(ZYGOTE_ENV, "0")
    assert engine_spawn(python, VLLM, dict(os.environ)) is None
    monkeypatch.delenv(ZYGOTE_ENV)
    before = dict(_ZYGOTES)
    first = engine_spawn(python, VLLM, dict(os.environ))
    second = engine_spawn(python, VLLM, dict(os.environ))
    assert first is not None and first == second  # the same zygote's bound spawn
    zygote, logs = _ZYGOTES[(str(python), VLLM.module)]
    try:
        assert zygote.pid is None  # nothing started before the first engine
    finally:
        zygote.close()
        shutil.rmtree(logs, ignore_errors=True)
        _ZYGOTES.clear()
        _ZYGOTES.update(before)
