"""``process_running`` / ``process_start``: the owner check behind locks, markers and work folders."""

from __future__ import annotations

import os
import subprocess
import sys

from lightning_accel._utils.processes import process_running, process_start


def test_a_running_process_and_one_that_ended() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    assert process_running(os.getpid())
    assert not process_running(child.pid)
    assert process_running(1)  # init: always there (for another user the kernel refuses the signal, still True)


def test_the_start_time_tells_a_process_from_a_later_one() -> None:
    mine = process_start(os.getpid())
    assert mine is not None and mine == process_start(os.getpid())
    assert process_start(os.getpid()) != process_start(1)
    assert process_start(2**22 + 12345) is None  # no such pid
