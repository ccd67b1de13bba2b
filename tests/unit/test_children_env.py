"""A child started while another thread changes this process's environment.

CPython starts children with vfork: the child runs on the parent's memory until
it execs. Given no ``env``, it execs with the C ``environ`` array, which a
``putenv`` on another thread (``os.environ[...] = ...``, pytest's ``setenv``)
may reallocate and free meanwhile; the exec then fails with EFAULT. The
conformance harness starts its engines and indexers on worker threads while the
tests go on, so a child must never be started on the live ``environ``.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import pytest

from lab.children import ChildProcess, child_env

#: Starts per case: with the live environ about a third of them fail here, so
#: 150 fail a broken start (almost) surely.
STARTS = 150
TRUE = "/bin/true"


@contextmanager
def _environ_churn() -> Iterator[None]:
    """Another thread setting and unsetting variables of its own, growing and
    shrinking the C environ array, until the block ends."""
    stop = threading.Event()
    names = [f"KVMESH_TEST_CHURN_{i}" for i in range(200)]

    def churn() -> None:
        i = 0
        while not stop.is_set():
            os.environ[names[i % len(names)]] = "x" * (i % 50)
            if i % 3 == 0:
                os.environ.pop(names[(i * 7) % len(names)], None)
            i += 1

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        for name in names:
            os.environ.pop(name, None)


def _failed_starts(start: object, starts: int = STARTS, first_only: bool = False) -> list[OSError]:
    """The OSErrors of ``starts`` calls of ``start`` under the churn (with
    ``first_only``: up to the first)."""
    failures: list[OSError] = []
    with _environ_churn():
        for _ in range(starts):
            try:
                start()  # type: ignore[operator]
            except OSError as e:
                failures.append(e)
                if first_only:
                    break
    return failures


def test_children_start_while_another_thread_changes_the_environment() -> None:
    def start() -> None:
        child = ChildProcess([TRUE])
        child.start()
        child.proc.wait()

    assert _failed_starts(start) == []


def test_a_child_given_an_environment_gets_exactly_it() -> None:
    assert child_env({"A": "1"}) == {"A": "1"}
    snapshot = child_env(None)
    assert snapshot == dict(os.environ)
    os.environ["KVMESH_TEST_AFTER_SNAPSHOT"] = "1"
    try:
        assert "KVMESH_TEST_AFTER_SNAPSHOT" not in snapshot
    finally:
        del os.environ["KVMESH_TEST_AFTER_SNAPSHOT"]


def test_the_race_is_real_with_the_live_environ() -> None:
    """The broken way (Popen with no env) fails under the same churn: the test
    above would catch a ChildProcess that went back to it."""

    def start_live(env: Mapping[str, str] | None = None) -> None:
        subprocess.Popen([TRUE], env=env, start_new_session=True).wait()

    # Up to 2,000 starts (a few seconds), stopping at the first failure.
    failures = _failed_starts(start_live, 2000, first_only=True)
    if not failures:
        pytest.fail("no start failed on the live environ: the churn no longer shows the race")
    assert all(e.errno == 14 for e in failures), failures[:3]
