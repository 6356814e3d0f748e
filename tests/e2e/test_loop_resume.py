"""Checkpoint and resume through the real loop (scripts/run-tiny-cpu.sh: local Ray, SGLang engine, Megatron
actor): 4 steps in one run equal 2 steps, a resume from the checkpoint after step 1, and 2 more steps, even when
the newest checkpoint is damaged and a training rank is SIGKILLed on the way (--max-restarts).

Two runs, not three: the 4-step run (the session's saved_tiny_run, tests/e2e/conftest.py) saves after steps 1 and
3 (--save-interval 2), so its first half is the "2 steps" run; the resumed run loads the step-1 checkpoint and
runs steps 2 and 3. A save that disturbed the run would show as a difference too, since the resumed run is
compared with the run that saved. The resumed run writes into a copy of the first run's experiment directory (the
session's other tests read the original): one run, one record, continued from the checkpoint. The same resumed
run also shows the two faults a run survives on its own: it is given the checkpoints with step 3's damaged, and
passes over it to step 1's; its training rank is killed after step 2, and the run restarts from its own step-2
checkpoint, ending on the uninterrupted run's weights. The first run also writes HF directories (--save-hf), which
must hold its checkpoints' weights; `relax train --eval-only` on the last one samples on the eval sets what the
trained engine sampled in the run's last evaluation (same seeds, same metrics). The resumed run evaluates at step 2
and after its last step, as the first run did then, with the same metrics.

Rollouts repeat exactly only because each request samples with a seed derived from (--seed, step), which
SGLang honours under --sglang-enable-deterministic-inference. Same tokens, same rewards: those are compared
exactly. Training on the CPU is deterministic as well (same weights, optimizer state and batch, one thread);
the losses get a 1e-6 tolerance only for the floating-point sums, which are not guaranteed bit for bit.
"""

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from processes import describe, kill_marked, leftover_processes, run_marker, wait_for_process
from relax.run.metrics import read_metrics
from relax.run.state import read_checkpoint
from relax.train.saved_steps import LATEST
from tiny_runs import (
    ROOT, SAVING_RUN_STEPS as STEPS, eval_flags, eval_set_paths, run_tiny_job, step_records, tiny_job,
)

pytestmark = pytest.mark.long  # pytest.ini: not in CI's run

EXACT_KEYS = ("rollout/reward_mean", "rollout/reward_std", "rollout/response_length_mean", "rollout/truncated_fraction")
CLOSE_KEYS = ("train/loss", "train/pg_loss", "train/clip_fraction", "train/ppo_kl", "train/grad_norm", "train/lr")


@pytest.mark.timeout(900)  # the saved run (its fixture), then the resumed run's two starts of the whole stack
def test_four_steps_equal_two_steps_then_resume_and_two_more(saved_tiny_run, tmp_path):
    whole, saves, hf_saves = saved_tiny_run.records, saved_tiny_run.saves, saved_tiny_run.hf_saves
    assert [r["step"] for r in whole] == [0, 1, 2, 3, 4]  # 4: the evaluation after the last step
    assert (saves / LATEST).read_text().strip() == "step_000003"
    # --save-hf wrote an HF directory at each save, holding the weights of that step's checkpoint exactly
    assert sorted(p.name for p in hf_saves.iterdir()) == ["step_000001", "step_000003"]
    converted = tmp_path / "converted"
    subprocess.run(
        [str(ROOT / ".venv" / "bin" / "relax"), "convert", "--load", str(saves), "--out", str(converted)],
        check=True, capture_output=True, timeout=300,
    )
    trained = transformers.AutoModelForCausalLM.from_pretrained(hf_saves / "step_000003", dtype=torch.float32)
    checkpointed = load_file(converted / "model.safetensors")
    assert trained.state_dict().keys() == checkpointed.keys()
    assert all(torch.equal(trained.state_dict()[k], v.float()) for k, v in checkpointed.items())
    # `relax train --eval-only` on the HF directory: SGLang's engine loads it and samples the eval sets as the trained
    # engine did in the run's last evaluation (the same eval sampling and --seed): the same tokens give the same
    # rewards, lengths and pass@k, and no training actor is created.
    evaluated = _evaluate_only(hf_saves / "step_000003", tmp_path / "eval_only")
    assert evaluated == {key: value for key, value in whole[-1].items() if key.startswith("eval/")}
    after_step_1 = saves / "step_000001"
    assert read_checkpoint(after_step_1, saved_tiny_run.exp_dir / "model", seed=1234, num_steps=STEPS).next_step == 2

    # Resumed in a copy of the run's experiment directory, from its checkpoints, whose newest (step 3) lost half a
    # file since: the run warns, naming it, and resumes from step 1. It saves after every step and may restart once;
    # its training rank is SIGKILLed once step 2 is logged, so the run restarts from step 2's checkpoint and does
    # step 3 on new workers.
    exp_dir = tmp_path / "resumed_run"
    shutil.copytree(saved_tiny_run.exp_dir, exp_dir)
    resumed_saves, resumed_hf_saves = exp_dir / saves.name, tmp_path / "hf"
    step_3_files = [path for path in (resumed_saves / "step_000003").rglob("*") if path.is_file()]
    damaged = max(step_3_files, key=lambda path: path.stat().st_size)
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    damaged_size = damaged.stat().st_size  # the resumed run saves step 3 anew, over the damaged file
    # Into the copied experiment directory (the script passes --overwrite-output-dir, which a resumed run does not
    # act on): the run's record continues from the checkpoint, the first run's steps 2 and 3 replaced.
    marker = run_marker()
    command, env = tiny_job(
        exp_dir, "--num-steps", str(STEPS), "--sglang-enable-deterministic-inference",
        "--load", str(resumed_saves), "--save", str(resumed_saves), "--save-interval", "1",
        "--save-hf", str(resumed_hf_saves), "--max-restarts", "1", *eval_flags(exp_dir), env=marker,
    )
    output = _run_killing_the_training_rank_after_step_2(command, env, marker, resumed_saves, tmp_path / "resumed.log")
    assert (f"relax: warning: checkpoint {resumed_saves / 'step_000003'} is incomplete ({damaged} has "
            f"{damaged_size} bytes") in output, output[-6000:]
    assert f"resuming from {resumed_saves / 'step_000001'} instead" in output
    assert "training rank 0 (TrainWorker, pid" in output
    assert f"relax train: restart 1 of at most 1: resuming from {resumed_saves}\n" in output
    assert "  restarts      1: resumed from a checkpoint after a training rank or an engine failed" in output
    leftover = leftover_processes(marker)
    assert not leftover, f"processes of the run left behind: {describe(leftover)}"

    record = read_metrics(exp_dir / "output" / "metrics.jsonl")
    assert [r["step"] for r in record] == [0, 1, 2, 3, 4]
    assert record[:2] == whole[:2]
    resumed = record[2:]
    assert [r["faults/run_restarts"] for r in step_records(resumed)] == [0, 1]
    # The final weights equal the uninterrupted run's.
    for name in sorted(p.name for p in (hf_saves / "step_000003").glob("*.safetensors")):
        final, uninterrupted = (load_file(d / "step_000003" / name) for d in (resumed_hf_saves, hf_saves))
        assert final.keys() == uninterrupted.keys()
        assert all(torch.equal(final[k], uninterrupted[k]) for k in final), name
    # Step 2 checks the loaded weights, data position and sampling seeds; step 3 also the optimizer, scheduler and
    # RNG states: its weights come out of step 2's Adam update.
    for original, again in zip(whole[2:], resumed):
        for key in [*EXACT_KEYS, *(key for key in original if key.startswith("eval/"))]:
            if key in original:
                assert again[key] == original[key], f"step {original['step']} {key}: {again[key]} != {original[key]}"
        for key in CLOSE_KEYS:
            if key in original:
                assert abs(again[key] - original[key]) <= 1e-6, f"step {original['step']} {key}"
    # The run learns in these steps (else equal losses would prove little): the weights moved the rewards.
    steps = step_records(whole)
    assert len({r["rollout/reward_mean"] for r in steps}) > 1 or len({r["train/loss"] for r in steps}) > 1


def _run_killing_the_training_rank_after_step_2(command, env, marker, saves: Path, log_path: Path) -> str:
    """Run `command` (a tiny job marked with `marker`, saving into `saves` after every step) to its end, SIGKILLing
    its training rank once it has saved step 2 and logged it; its output. Fails when the run fails, or ends before.
    (The metrics file holds the earlier run's step 2 until this run's record replaces it, before its first save.)"""
    metrics, latest = Path(env["EXP_DIR"]) / "output" / "metrics.jsonl", saves / LATEST
    with open(log_path, "w") as log:
        run = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (latest.read_text().strip() == "step_000002" and '{"step": 2,' in metrics.read_text()):
            assert run.poll() is None, f"the run ended before step 2:\n{log_path.read_text()[-6000:]}"
            assert time.monotonic() < deadline, "no step 2 within 600 s"
            time.sleep(0.2)
        wait_for_process(marker, "ray::TrainWorker", still_running=lambda: run.poll() is None).kill()
        run.wait(timeout=600)
    finally:
        if run.poll() is None:  # the test failed: end the whole run, not only its driver
            kill_marked(marker)
            run.wait()
    output = log_path.read_text()
    assert run.returncode == 0, output[-6000:]
    return output


def _evaluate_only(hf_checkpoint: Path, exp_dir: Path) -> dict:
    """The eval/ metrics of `relax train --eval-only` on `hf_checkpoint` through the tiny job in a new `exp_dir`
    (its data rebuilt there as in every run), with the saving run's eval sets (tiny_runs.eval_set_paths)."""
    exp_dir.mkdir()
    pairs = [str(part) for name, path in eval_set_paths(exp_dir).items() for part in (name, path)]
    records = run_tiny_job(
        exp_dir, "--eval-only", "--hf-checkpoint", str(hf_checkpoint), "--sglang-enable-deterministic-inference",
        "--eval-prompt-data", *pairs,
    )
    assert [r["step"] for r in records] == [0], records
    assert not any(key.startswith(("train/", "rollout/")) for key in records[0]), records[0]
    return {key: value for key, value in records[0].items() if key.startswith("eval/")}
