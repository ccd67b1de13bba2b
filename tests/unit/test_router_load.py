"""Load tracking: exact under concurrency; reports and router bookkeeping never double count."""

from __future__ import annotations

import subprocess
import sys
import threading

from router_client import CircuitBreaker, Limits, LoadTracker, WorkerLoad


def test_exact_under_threads() -> None:
    t = LoadTracker()
    n_threads, per = 8, 2000

    def work(k: int) -> None:
        for i in range(per):
            t.start((k, i), f"w{i % 3}", 10, 5)
            if i % 2:
                t.finish((k, i))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    total = sum(t.load(f"w{j}").running_requests for j in range(3))
    assert total == n_threads * per // 2 == t.in_flight()
    assert sum(t.load(f"w{j}").total_tokens for j in range(3)) == total * 10


def test_report_replaces_requests_started_before_it() -> None:
    now = [0.0]
    t = LoadTracker(clock=lambda: now[0])
    t.start("r1", "a", 100, 50)
    now[0] = 1.0
    t.report("a", WorkerLoad(1, 100, 50))  # the engine has seen r1
    assert t.load("a") == WorkerLoad(1, 100, 50)
    now[0] = 2.0
    t.start("r2", "a", 10, 10)  # after the report: added on top
    assert t.load("a") == WorkerLoad(2, 110, 60)
    t.finish("r2")
    t.finish("r2")  # idempotent
    assert t.load("a") == WorkerLoad(1, 100, 50)
    t.report("a", WorkerLoad(0, 0, 0), at=0.5)  # older than the last: ignored
    assert t.load("a") == WorkerLoad(1, 100, 50)


def test_admission_limits_and_fail_open() -> None:
    now = [0.0]
    t = LoadTracker(stale_after_s=5, clock=lambda: now[0])
    lim = Limits(max_running_requests=2, max_pending_prefill_tokens=100)
    assert t.admits("a", lim)  # no report: fail open
    t.report("a", WorkerLoad(2, 0, 0))
    assert not t.admits("a", lim)
    t.report("a", WorkerLoad(1, 0, 90))
    assert t.admits("a", lim, 10) and not t.admits("a", lim, 11)
    now[0] = 10.0  # stale: fail open
    assert t.admits("a", lim, 1000)


def test_breaker_opens_half_opens_and_closes() -> None:
    now = [0.0]
    b = CircuitBreaker(2, 1.0, clock=lambda: now[0])
    b.failure()
    assert b.allow()
    b.failure()
    assert b.state == "open" and not b.allow()
    now[0] = 1.5
    assert b.allow() and not b.allow()  # one probe only
    b.failure()  # failed probe: open again
    assert b.state == "open"
    now[0] = 3.0
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow()


def test_router_client_never_imports_indexer() -> None:
    code = (
        "import sys, router_client, router_client.router, router_client.indexer_client\n"
        "bad = [m for m in sys.modules if m == 'indexer' or m.startswith('indexer.')]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
