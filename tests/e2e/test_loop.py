"""The colocated loop end to end on CPU: the README's main job (scripts/run-tiny-cpu.sh), shortened to a
few steps, through the real stack (local Ray, SGLang engine actor, Megatron training actor); run twice into
the same experiment directory, as a user reruns it, the second run's record replaces the first's."""

import json
import math
import os
import subprocess
from pathlib import Path

from processes import describe, leftover_processes, run_marker

ROOT = Path(__file__).resolve().parents[2]
PERF_KEYS = ("perf/step_time", "perf/rollout_time", "perf/train_wait_time", "perf/train_time", "perf/weight_sync_time")


def tiny_run(exp_dir: Path, marker: dict, num_steps: int) -> None:
    env = {**os.environ, **marker, "EXP_DIR": str(exp_dir), "RELAX_PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run-tiny-cpu.sh"), "--num-steps", str(num_steps)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def read_records(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def test_tiny_colocated_run_logs_every_phase_and_leaves_no_process(tmp_path):
    marker = run_marker()
    tiny_run(tmp_path, marker, num_steps=3)

    output = tmp_path / "output"
    records = read_records(output)
    assert [r["step"] for r in records] == [0, 1, 2]
    vocab_size = json.loads((tmp_path / "model" / "config.json").read_text())["vocab_size"]
    for record in records:
        for key in (*PERF_KEYS, "rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/grad_norm"):
            assert key in record, f"step {record['step']} lacks {key}"
        assert record["perf/step_time"] >= record["perf/rollout_time"] + record["perf/train_time"]
        assert 0.0 <= record["rollout/reward_mean"] <= 1.0
        # The policy's entropy every step, although the recipe has no entropy term in its loss.
        assert 0.0 < record["train/entropy"] <= math.log(vocab_size), record
        # The engine's logprob of each response token against the actor's for the same token: both compute in
        # float32 on the same weights, so they agree to rounding (a token off by one position would not).
        assert record["mismatch/logprob_abs_diff_max"] < 1e-4, record
        assert record["mismatch/ratio_min"] <= record["mismatch/ratio_mean"] <= record["mismatch/ratio_max"]
        assert record["mismatch/ratio_outside_0.5_2_fraction"] == 0.0 and 0.0 <= record["mismatch/k3_kl"] < 1e-8
    # Every optimizer step went through, and every weight push was complete: the engine refuses an update
    # that misses a checkpoint tensor, which would have failed the run.
    assert all(r["train/update_successful"] == 1.0 for r in records)
    assert list((output / "tensorboard").glob("events.out.tfevents.*"))
    assert (output / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
    leftover = leftover_processes(marker)
    assert not leftover, f"processes left behind by the run: {describe(leftover)}"

    # The same job again: a new run, whose record replaces the first one's rather than continuing it.
    first_events = set((output / "tensorboard").iterdir())
    tiny_run(tmp_path, marker, num_steps=2)
    assert [r["step"] for r in read_records(output)] == [0, 1]
    events = set((output / "tensorboard").iterdir())
    assert len(events) == 1 and not events & first_events, (first_events, events)
