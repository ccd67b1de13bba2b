"""The indexer raises its open-file limit to what its engine endpoints need.

Each case runs in a child process, so this one's limits stay as they are.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

resource = pytest.importorskip("resource")

_CHILD = """
import logging, resource, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
from indexer.kvevents.subscriber import ensure_fd_limit
resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))
got = ensure_fd_limit({want}, "600 engine endpoints")
print("GOT", got, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _run(soft: int, hard: int, want: int) -> tuple[int, int, str]:
    _, real_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if real_hard != resource.RLIM_INFINITY and real_hard < hard:
        pytest.skip(f"this process may open at most {real_hard} files")
    code = _CHILD.format(soft=soft, hard=hard, want=want)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("GOT "))
    _, got, soft_after = line.split()
    return int(got), int(soft_after), out


def test_a_low_soft_limit_is_raised_to_what_the_endpoints_need() -> None:
    got, soft, out = _run(512, 4096, 3000)
    assert (got, soft) == (3000, 3000)
    assert "raised from 512 to 3000" in out and "WARNING" not in out


def test_a_hard_limit_below_the_need_is_reached_and_named() -> None:
    got, soft, out = _run(256, 1024, 5000)
    assert (got, soft) == (1024, 1024)
    assert "WARNING 600 engine endpoints need about 5000 open files" in out


def test_a_limit_already_high_enough_is_left_alone() -> None:
    got, soft, out = _run(2048, 4096, 1000)
    assert (got, soft) == (2048, 2048)
    assert "raised" not in out
