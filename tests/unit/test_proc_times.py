"""What ``kvmesh bench peer`` reads of a process besides its CPU seconds: the
split between its own code and the kernel, and its page faults
(``lab.children.proc_times``)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

from lab.bench.peer import Ingested
from lab.children import ProcTimes, proc_times

PAGES = 4096


def test_first_touches_are_counted_as_page_faults() -> None:
    before = proc_times(os.getpid())
    assert before is not None
    with mmap.mmap(-1, PAGES * mmap.PAGESIZE) as m:
        for off in range(0, PAGES * mmap.PAGESIZE, mmap.PAGESIZE):
            m[off] = 1
    after = proc_times(os.getpid())
    assert after is not None
    spent = after - before
    assert spent.minor_faults >= PAGES * 0.9
    assert spent.user_s >= 0 and spent.system_s >= 0
    # Reading the same memory again faults nothing new.
    again = proc_times(os.getpid())
    assert again is not None and again.minor_faults - after.minor_faults < PAGES // 10


def test_a_process_that_is_gone_has_no_times() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert proc_times(child.pid) is None


def test_kernel_figures_are_shares_of_the_round() -> None:
    done = Ingested(2.0, {}, None, times=ProcTimes(3.0, 1.0, 500))
    assert done.kernel_figures(1000) == {
        "kernel_cpu_share": 0.25,
        "page_faults_per_block_instance": 0.5,
        "kernel_us_per_page_fault": 2000.0,
    }
    assert set(done.kernel_figures(1000, "_probed")) == {
        "kernel_cpu_share_probed",
        "page_faults_per_block_instance_probed",
        "kernel_us_per_page_fault_probed",
    }
    # No faults: no cost per fault.
    quiet = Ingested(2.0, {}, None, times=ProcTimes(3.0, 1.0, 0)).kernel_figures(1000)
    assert "kernel_us_per_page_fault" not in quiet and quiet["kernel_cpu_share"] == 0.25
    assert Ingested(2.0, {}, None).kernel_figures(1000) == {}
    assert Ingested(2.0, {}, None, times=ProcTimes(0.0, 0.0, 3)).kernel_figures(1000) == {}
