"""The liveness watch's judgement of one recorded process (relax.ray.watch), on processes of this machine."""

import os
import subprocess
import sys

from relax.ray.watch import CLOCK_SLACK_S, attach, process_records, process_state


def test_a_running_process_whose_start_time_moved_with_the_clock_is_still_the_recorded_one():
    (record,) = process_records([os.getpid()])
    moved = {**record, "created": record["created"] - 1.0}  # a clock correction between record and watch
    process = attach(moved)
    assert not isinstance(process, str), process
    assert process_state(process) is None


def test_a_recorded_start_time_far_from_the_pids_process_is_a_reused_pid():
    (record,) = process_records([os.getpid()])
    older = {**record, "created": record["created"] - 10 * CLOCK_SLACK_S}
    assert attach(older) == "exited (its pid now belongs to another process)"


def test_a_process_that_ends_after_the_watch_began_is_reported_exited():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (record,) = process_records([child.pid])
    process = attach(record)
    assert process_state(process) is None
    child.kill()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has ended; this test, its parent, has not reaped it
    assert process_state(process) == "exited (a zombie now)"
    child.wait()
    assert process_state(process) == "exited"
    assert attach(record) == "exited"
