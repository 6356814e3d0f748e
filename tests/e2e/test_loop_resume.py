"""Checkpoint and resume through the real loop (scripts/run-tiny-cpu.sh: local Ray, SGLang engine, Megatron
actor): 4 steps in one run equal 2 steps, a resume from the checkpoint after step 1, and 2 more steps.

Two runs, not three: the 4-step run (the session's saved_tiny_run, tests/e2e/conftest.py) saves after steps 1 and
3 (--save-interval 2), so its first half is the "2 steps" run; the resumed run loads the step-1 checkpoint and
runs steps 2 and 3. A save that disturbed the run would show as a difference too, since the resumed run is
compared with the run that saved. The resumed run writes into the first run's experiment directory: one run, one
record, continued from the checkpoint. The first run also writes HF directories (--save-hf), which must hold its
checkpoints' weights, and from which SGLang's engine starts and greedy-decodes as HF transformers does.

Rollouts repeat exactly only because each request samples with a seed derived from (--seed, step), which
SGLang honours under --sglang-enable-deterministic-inference. Same tokens, same rewards: those are compared
exactly. Training on the CPU is deterministic as well (same weights, optimizer state and batch, one thread);
the losses get a 1e-6 tolerance only for the floating-point sums, which are not guaranteed bit for bit.
"""

import subprocess

import torch
import transformers
from safetensors.torch import load_file

from generations import assert_same_generations
from hf_reference import hf_greedy
from relax.platform import get_platform
from relax.rollout.engine import RolloutEngine, SamplingConfig
from relax.run.state import LATEST, read_checkpoint
from tiny_runs import ROOT, SAVING_RUN_STEPS as STEPS, run_tiny_job

PROBE_PROMPTS = [[5, 6, 7], [1, 33, 31, 17, 30, 54, 15]]

EXACT_KEYS = ("rollout/reward_mean", "rollout/reward_std", "rollout/response_length_mean", "rollout/truncated_fraction")
CLOSE_KEYS = ("train/loss", "train/pg_loss", "train/clip_fraction", "train/ppo_kl", "train/grad_norm", "train/lr")


def test_four_steps_equal_two_steps_then_resume_and_two_more(saved_tiny_run, tmp_path):
    whole, saves, hf_saves = saved_tiny_run.records, saved_tiny_run.saves, saved_tiny_run.hf_saves
    assert [r["step"] for r in whole] == [0, 1, 2, 3]
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
    # SGLang's engine loads the HF directory and greedy-decodes what HF transformers decodes from it.
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    with RolloutEngine({"max_total_tokens": 4096}, model_path=str(hf_saves / "step_000003"),
                       platform=get_platform("cpu")) as engine:
        engine_outputs = [(c.token_ids, c.logprobs) for (c,) in engine.generate(PROBE_PROMPTS, greedy)]
    assert_same_generations(engine_outputs, hf_greedy(hf_saves / "step_000003", PROBE_PROMPTS, 6))
    after_step_1 = saves / "step_000001"
    assert read_checkpoint(after_step_1, saved_tiny_run.exp_dir / "model", seed=1234, num_steps=STEPS).next_step == 2

    # Resumed into the same experiment directory (the script passes --overwrite-output-dir, which a resumed run
    # does not act on): the run's record continues from the checkpoint, the first run's steps 2 and 3 replaced.
    record = run_tiny_job(
        saved_tiny_run.exp_dir, "--num-steps", str(STEPS), "--sglang-enable-deterministic-inference",
        "--load", str(after_step_1),
    )
    assert [r["step"] for r in record] == [0, 1, 2, 3]
    assert record[:2] == whole[:2]
    resumed = record[2:]
    # Step 2 checks the loaded weights, data position and sampling seeds; step 3 also the optimizer, scheduler and
    # RNG states: its weights come out of step 2's Adam update.
    for original, again in zip(whole[2:], resumed):
        for key in EXACT_KEYS:
            assert again[key] == original[key], f"step {original['step']} {key}: {again[key]} != {original[key]}"
        for key in CLOSE_KEYS:
            if key in original:
                assert abs(again[key] - original[key]) <= 1e-6, f"step {original['step']} {key}"
    # The run learns in these steps (else equal losses would prove little): the weights moved the rewards.
    assert len({r["rollout/reward_mean"] for r in whole}) > 1 or len({r["train/loss"] for r in whole}) > 1
