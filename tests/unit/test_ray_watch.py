"""The liveness watch's judgement of one recorded process (relax.ray.watch), on processes of this machine."""

import os
import subprocess
import sys

import psutil

from relax.ray.watch import START_SLACK_S, process_records, process_state


def test_a_clock_correction_does_not_make_a_running_process_another_one(monkeypatch):
    (record,) = process_records([os.getpid()])
    boot_time = psutil.boot_time()
    # The kernel recomputes the boot time from the system clock: both start readings move with it.
    monkeypatch.setattr(psutil, "boot_time", lambda: boot_time + 1.0)
    monkeypatch.setattr(psutil.Process, "create_time", lambda self, real=psutil.Process.create_time: real(self) + 1.0)
    assert process_state(record) is None


def test_a_recorded_start_far_from_the_pids_process_is_a_reused_pid():
    (record,) = process_records([os.getpid()])
    older = {**record, "started": record["started"] - 10 * START_SLACK_S}
    assert process_state(older) == "exited (its pid now belongs to another process)"


def test_a_process_that_ends_is_reported_exited_then_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (record,) = process_records([child.pid])
    assert process_state(record) is None
    child.kill()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has ended; this test, its parent, has not reaped it
    assert process_state(record) == "exited (a zombie now)"
    child.wait()
    assert process_state(record) == "exited"
