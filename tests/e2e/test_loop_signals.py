"""SIGTERM to the `relax train` driver mid-run (scripts/run-tiny-cpu.sh, the real stack): the step in progress
finishes, its state is saved to --save, engines, actors and the local Ray end, the run's summary is printed,
and the driver exits 143 with one line saying so. The run over-samples with partial rollout: the groups the step
put back are saved with the loader, with what their responses generated.

The same run shows partial rollout itself (the signal comes during step 1's rollout): with responses of up to
48 tokens, the groups in flight when step 0's batch is full have tokens (or are complete), which go back with their
prompts; step 1 takes them first and continues what they began (how many were cut short mid-response depends on
timing: tests/e2e/test_engine.py shows the engine continuing a response as the uninterrupted request would,
tests/unit/test_rollout_driver.py the rollout's bookkeeping)."""

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from relax.rollout.dump import rollout_data_path
from relax.run.state import read_checkpoint
from processes import describe, kill_marked, leftover_processes, run_marker, wait_for_process, wait_for_title
from tiny_runs import EIGHT_PROMPTS, tiny_job

pytestmark = pytest.mark.long  # pytest.ini: not in CI's run


def wait_for_first_step(metrics: Path, driver: subprocess.Popen, stderr: Path, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and driver.poll() is None:
        if metrics.is_file() and metrics.read_text().endswith("\n"):
            return
        time.sleep(0.5)
    raise AssertionError(f"no step was logged (driver exit status {driver.poll()}):\n{stderr.read_text()[-5000:]}")


def test_sigterm_mid_run_saves_the_step_stops_everything_and_exits_143(tmp_path):
    marker = run_marker()
    saves, pattern = tmp_path / "checkpoints", str(tmp_path / "rollouts" / "step_{step}.jsonl")
    command, env = tiny_job(tmp_path, "--num-steps", "50", "--save", str(saves), *EIGHT_PROMPTS,
                            "--over-sampling-batch-size", "16", "--partial-rollout", "--max-staleness", "1",
                            "--rollout-max-response-len", "48", "--save-rollout-data", pattern, env=marker)
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    # run-tiny-cpu.sh execs the driver: the Popen's pid is the driver's.
    with open(stdout, "w") as out, open(stderr, "w") as err:
        driver = subprocess.Popen(command, env=env, stdout=out, stderr=err)
    try:
        wait_for_first_step(tmp_path / "output" / "metrics.jsonl", driver, stderr)
        # Once the engine generates for step 1, the driver has looked for a signal after step 0: the run stops after
        # step 1, and the record has the two steps the partial-rollout checks read.
        engine = wait_for_process(marker, "ray::EngineWorker", still_running=lambda: driver.poll() is None)
        wait_for_title(engine, "EngineWorker.generate", still_running=lambda: driver.poll() is None)
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
    records = [json.loads(line) for line in (tmp_path / "output" / "metrics.jsonl").read_text().splitlines()]
    steps = [record["step"] for record in records]
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

    # Partial rollout: step 0 put back 8 groups with their tokens so far; step 1 took them first.
    assert steps[:2] == [0, 1]
    first, second = records[:2]
    assert first["rollout/returned_prompts"] == 8 and first["rollout/partial_carried_tokens"] > 0, first
    assert first["rollout/partial_resumed_samples"] == 0 and first["rollout/partial_oldest_token_age"] == 0
    # Whether the carried groups complete before 8 others (they had a head start) or are cut short again, with more
    # tokens, depends on the engine's timing; nothing is lost either way.
    assert second["rollout/partial_stale_samples"] == 0  # one step old: within --max-staleness
    if second["rollout/partial_resumed_samples"]:
        assert second["rollout/partial_oldest_token_age"] == 1 and second["rollout/partial_old_token_fraction"] > 0
    else:
        assert second["rollout/partial_carried_tokens"] > 0, second
    assert second["train/update_successful"] == 1.0 and "mismatch/logprob_abs_diff_mean" in second
    groups = [json.loads(line) for line in rollout_data_path(pattern, 1).read_text().splitlines()[1:]]
    assert len({group["prompt"]["row"] for group in groups}) == 8  # a full batch, no prompt twice in a step
