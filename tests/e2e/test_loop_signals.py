"""SIGTERM to the `relax train` driver mid-run (scripts/run-tiny-cpu.sh, the real stack): the step in progress
finishes, its state is saved to --save, engines, actors and the local Ray end, the run's summary is printed,
and the driver exits 143 with one line saying so. The run over-samples with partial rollout: the groups the step
put back are saved with the loader, with what their responses generated."""

import json
import signal
import subprocess
import time
from pathlib import Path

from relax.run.state import read_checkpoint
from processes import describe, kill_marked, leftover_processes, run_marker
from tiny_runs import tiny_job


def wait_for_first_step(metrics: Path, driver: subprocess.Popen, stderr: Path, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and driver.poll() is None:
        if metrics.is_file() and metrics.read_text().endswith("\n"):
            return
        time.sleep(0.5)
    raise AssertionError(f"no step was logged (driver exit status {driver.poll()}):\n{stderr.read_text()[-5000:]}")


def test_sigterm_mid_run_saves_the_step_stops_everything_and_exits_143(tmp_path):
    marker = run_marker()
    saves = tmp_path / "checkpoints"
    command, env = tiny_job(tmp_path, "--num-steps", "50", "--save", str(saves), "--over-sampling-batch-size", "16",
                            "--partial-rollout", env=marker)
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    # run-tiny-cpu.sh execs the driver: the Popen's pid is the driver's.
    with open(stdout, "w") as out, open(stderr, "w") as err:
        driver = subprocess.Popen(command, env=env, stdout=out, stderr=err)
    try:
        wait_for_first_step(tmp_path / "output" / "metrics.jsonl", driver, stderr)
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
        leftover = leftover_processes(marker)
        kill_marked(marker)
    assert driver.returncode == 128 + signal.SIGTERM, stdout.read_text()[-2000:] + stderr.read_text()[-5000:]

    last_line = stderr.read_text().strip().splitlines()[-1]
    assert last_line.startswith("relax train: stopped by SIGTERM after step "), stderr.read_text()[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "output" / "metrics.jsonl").read_text().splitlines()]
    # The step that was running when the signal came finished (and was logged) before the save.
    assert last_line.endswith(f"after step {steps[-1]}; checkpoint in {saves / f'step_{steps[-1]:06d}'}")
    checkpoint = read_checkpoint(saves, tmp_path / "model", seed=1234, num_steps=50)
    assert checkpoint.next_step == steps[-1] + 1 < 50
    # 16 groups in flight for 8: the 8 others went back to the loader, each with its responses so far (or None)
    loader = checkpoint.loader_state
    assert len(loader["put_back"]) == len(loader["put_back_progress"]) == 8
    for group in filter(None, loader["put_back_progress"]):
        assert len(group["responses"]) == 8
        assert all(len(r["token_ids"]) == len(r["logprobs"]) == len(r["steps"]) for r in group["responses"])
    assert not leftover, f"processes left behind by the run: {describe(leftover)}"
    # The run's summary came before the driver's last line, counting the steps that finished.
    summary = stdout.read_text().split("relax run summary\n", 1)[1]
    assert summary.startswith(f"  steps         {len(steps)} (steps 0-{steps[-1]})\n")
    assert f"  checkpoints   {saves}\n" in summary
