"""A worker of the tiny colocated run (scripts/run-tiny-cpu.sh) killed with SIGKILL mid-run: the driver fails
soon, with a message naming the worker that died and where its log is, and no process of the run is left.

The bound on the driver's exit is a hang guard (a dead worker must not leave the driver waiting forever),
not a timing test."""

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from processes import describe, kill_marked, leftover_processes, run_marker, wait_for_process

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 120


def _wait_for_first_step(metrics: Path, run: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and metrics.read_text().strip()):
        assert run.poll() is None, f"the run ended before its first step:\n{log.read_text()[-6000:]}"
        assert time.monotonic() < deadline, f"no step within {timeout_s} s"
        time.sleep(0.2)


@pytest.mark.parametrize(
    "victim, named",
    [
        # Either the driver's liveness watch (relax.ray.watch) reports the death, within about a second, or the
        # call the driver waits on fails first (the engine actor checks its scheduler; Ray reports a dead
        # actor to calls on it): the tiny run's phases are too short to tell which. tests/e2e/test_worker_watch.py
        # shows the watch alone, while the driver waits on another group's slow call.
        ("sglang::scheduler", "engine 0"),
        ("ray::TrainWorker", "training rank 0"),
    ],
)
def test_worker_killed_mid_run_fails_the_run_naming_it_and_leaves_no_process(tmp_path, victim, named):
    marker = run_marker()
    env = {**os.environ, **marker, "EXP_DIR": str(tmp_path), "RELAX_PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        # Far more steps than the test waits for: the run is always mid-way when the worker is killed.
        run = subprocess.Popen(["bash", str(ROOT / "scripts" / "run-tiny-cpu.sh"), "--num-steps", "1000"],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_first_step(tmp_path / "output" / "metrics.jsonl", run, log_path)
        target = wait_for_process(marker, victim, still_running=lambda: run.poll() is None)
        target.kill()
        killed_at = time.monotonic()
        try:
            run.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the driver was still running {HANG_GUARD_S} s after {victim} (pid {target.pid}) was "
                        f"killed:\n{log_path.read_text()[-6000:]}")
        waited = time.monotonic() - killed_at
    finally:
        if run.poll() is None:  # the test failed: end the whole run, not only its driver
            kill_marked(marker)
            run.wait()
    output = log_path.read_text()
    assert run.returncode == 1, output[-6000:]
    steps = len((tmp_path / "output" / "metrics.jsonl").read_text().splitlines())
    print(f"{victim} killed after {steps} step(s); the driver exited {run.returncode} {waited:.1f} s later")
    # The driver's one-line message: which worker, its process, its log, and why.
    failure = [line for line in output.splitlines() if line.startswith("relax train: ")]
    assert failure, output[-6000:]
    assert f"{named} (" in failure[-1] and str(target.pid) in failure[-1], failure[-1]
    log_file = re.search(r"log: (\S+\.err)", failure[-1])
    assert log_file and Path(log_file.group(1)).is_file(), failure[-1]
    leftover = leftover_processes(marker)
    assert not leftover, f"processes of the run left behind: {describe(leftover)}"
