"""The loop's debug modes on the tiny CPU job (scripts/run-tiny-cpu.sh), through the real stack:

1. a normal run with --dynamic-sampling saves each step's rollout (--save-rollout-data); it over-samples
   (--over-sampling-batch-size 12 for 8 groups) with the engine running one group (8 requests) at a time, so that
   groups still wait in its queue when the batch is full: they are aborted through SGLang's abort and their prompts
   put back (relax.rollout.rollout.collect_groups), and no prompt is trained twice in a step. Its requests sample
   with seeds SGLang honours under deterministic inference, so how many groups dynamic sampling drops, and so how
   many are still in flight when the batch is full, is the same in every run;
2. --debug-train-only replays those files with no engine and trains to the very same losses (the actor
   starts from the same checkpoint and sees the same samples, the engine's logprobs included);
3. --debug-rollout-only generates, scores and saves with no training actor, into the normal run's output
   directory: a new run's record replaces the previous one's (as a user reruns the job) rather than continuing it.
   One call of its reward function never returns (the first, in the evaluation before step 0), and is timed out,
   counted and killed while the run goes on.

Which Ray actors each run created is read from its process tree while it runs."""

import json
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from relax.rollout.dump import load_rollout_data
from tiny_runs import EIGHT_PROMPTS, step_records, tiny_job

pytestmark = pytest.mark.long  # pytest.ini: not in CI's run

ACTORS = ("TrainWorker", "EngineWorker")
RUN_TIMEOUT_S = 600


def _run_tiny_job(exp_dir: Path, name: str, *flags: str,
                  output_name: str | None = None) -> tuple[list[dict], set[str]]:
    """Run the tiny job with extra flags, its output in exp_dir / (output_name or name); returns its steps' metrics
    records (tiny_runs.step_records) and the Ray actor classes seen among the run's processes. Python modules in
    exp_dir can be imported by the run."""
    output = exp_dir / (output_name or name)
    python_path = os.pathsep.join(filter(None, [str(exp_dir), os.environ.get("PYTHONPATH")]))
    command, env = tiny_job(exp_dir, "--output-dir", str(output), *EIGHT_PROMPTS, *flags,
                            env={"PYTHONPATH": python_path})
    log_path = exp_dir / f"{name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        seen, deadline = set(), time.monotonic() + RUN_TIMEOUT_S
        while process.poll() is None:
            if time.monotonic() > deadline:
                process.kill()
                raise AssertionError(f"{name} ran over {RUN_TIMEOUT_S} s; log: {log_path}")
            seen |= _actors_under(process.pid)
            time.sleep(0.5)
    assert process.returncode == 0, f"{name} failed:\n" + log_path.read_text()[-6000:]
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return step_records(records), seen


def _actors_under(pid: int) -> set[str]:
    """Ray actor classes among the descendants of `pid` (a Ray worker's title is ray::<Class>[.<method>])."""
    found = set()
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:  # exited meanwhile
            continue
        found.update(actor for actor in ACTORS if f"ray::{actor}" in command)
    return found


# copy_digit, except that the first call of the run never returns; it leaves its process id in the marker file.
HANGING_ONCE_REWARD = """
import os, time
from relax.rollout.synthetic import TASKS

def reward(sample):
    try:
        marker = os.open(os.path.join(os.path.dirname(__file__), "hung_pid"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return TASKS["copy_digit"].reward(sample)
    os.write(marker, str(os.getpid()).encode())
    os.close(marker)
    time.sleep(3600)
"""

# Importance-sampling corrections tight enough to act on float32 rounding-sized gaps between the engine's
# logprobs and the actor's: TIS caps every ratio above 1, MIS drops sequences whose mean gap exceeds 1e-7.
CORRECTIONS = ("--use-tis", "--tis-clip", "1.0", "--rollout-rs", "seq_mean_k1", "--rollout-rs-threshold", "1.0000001")


def test_saved_rollouts_replay_to_the_same_losses_and_each_debug_mode_creates_one_side(tmp_path):
    dumps = str(tmp_path / "dumps" / "step_{step}.jsonl")
    original, original_actors = _run_tiny_job(
        tmp_path, "original", "--num-steps", "2", "--save-rollout-data", dumps,
        "--dynamic-sampling", "--over-sampling-batch-size", "12", "--sglang-max-running-requests", "8",
        "--sglang-enable-deterministic-inference", *CORRECTIONS,
    )
    assert original_actors == {"TrainWorker", "EngineWorker"}  # the process-tree probe sees both kinds
    for record in original:
        # Prompts go out in chunks of 12; the groups in flight once 8 were kept are aborted and put back.
        assert record["rollout/kept_groups"] == 8 and record["rollout/submitted_groups"] % 12 == 0
        assert record["rollout/generated_groups"] + record["rollout/returned_prompts"] == (
            record["rollout/submitted_groups"]
        ), record
        assert record["rollout/returned_prompts"] > 0 and record["rollout/failed_groups"] == 0, record
        assert 0 <= record["rollout/aborted_groups"] <= record["rollout/returned_prompts"], record
    assert sum(record["rollout/aborted_groups"] for record in original) > 0  # cut short in the engine's queue
    for step in (0, 1):
        samples = load_rollout_data(dumps, step, num_groups=8, samples_per_prompt=8)
        assert all(len(set(s.reward for s in samples[g : g + 8])) > 1 for g in range(0, 64, 8))  # all informative
        rows = [sample.prompt.row for sample in samples[::8]]
        assert len(set(rows)) == 8, rows  # no prompt twice in a step

    assert any(r["mismatch/tis_clip_fraction"] > 0 and r["mismatch/mis_masked_fraction"] > 0 for r in original)

    replayed, replay_actors = _run_tiny_job(
        tmp_path, "train_only", "--num-steps", "2", "--debug-train-only", "--load-rollout-data", dumps, *CORRECTIONS,
    )
    assert replay_actors == {"TrainWorker"}
    assert [r["step"] for r in replayed] == [0, 1]
    for before, again in zip(original, replayed):
        keys = ["rollout/reward_mean", "train/loss", "train/pg_loss", "train/grad_norm"]
        keys += [key for key in before if key.startswith("mismatch/")]
        for key in keys:
            assert again[key] == before[key], f"step {before['step']} {key}: replayed {again[key]}, ran {before[key]}"

    rollout_dumps = str(tmp_path / "rollout_only" / "step_{step}.jsonl")
    original_events = set((tmp_path / "original" / "tensorboard").iterdir())
    (tmp_path / "hanging_once.py").write_text(HANGING_ONCE_REWARD)
    generated, generator_actors = _run_tiny_job(
        tmp_path, "rollout_only", "--num-steps", "1", "--debug-rollout-only", "--save-rollout-data", rollout_dumps,
        "--reward-fn", "hanging_once:reward", "--reward-timeout", "2", output_name="original",
    )
    assert generator_actors == {"EngineWorker"}
    # A new run (the script passes --overwrite-output-dir): its record and events replace the original run's.
    assert [r["step"] for r in generated] == [0] and "rollout/reward_mean" in generated[0]
    events = set((tmp_path / "original" / "tensorboard").iterdir())
    assert len(events) == 1 and not events & original_events, (original_events, events)
    # The script's held-out evaluation before step 0 makes the run's first reward calls.
    assert generated[0]["eval/held_out/reward_timeouts"] == generated[0]["eval/held_out/reward_failures"] == 1
    assert generated[0]["rollout/reward_timeouts"] == generated[0]["rollout/reward_failures"] == 0
    log = (tmp_path / "rollout_only.log").read_text()
    assert "(1 by timing out; each scored 0.0)" in log and "timed out: no score within 2 s" in log
    assert not psutil.pid_exists(int((tmp_path / "hung_pid").read_text()))  # the stuck worker was killed
    assert not [key for key in generated[0] if key.startswith("train/") or key == "perf/train_time"]
    assert len(load_rollout_data(rollout_dumps, 0, num_groups=8, samples_per_prompt=8)) == 64
