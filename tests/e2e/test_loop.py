"""The colocated loop end to end on CPU: the README's main job (scripts/run-tiny-cpu.sh), shortened to a few
steps, through the real stack (local Ray, SGLang engine actor, Megatron training actor). The run is the session's
saved_tiny_run (tests/e2e/conftest.py), which test_loop_resume resumes in a copy. A second run into the same experiment
directory replaces the first one's record: tests/e2e/test_loop_debug.py checks that on its rollout-only run. The run
evaluates two sets (tiny_runs.eval_flags) at step 0, every second step and after the last step."""

import json
import math

from relax.rollout.evaluation import pass_ks
from relax.run.metrics import RUN_RESTARTS
from tiny_runs import EVAL_INTERVAL, EVAL_SETS, PERF_KEYS, SAVING_RUN_STEPS, not_relax_lines

# Lines of the tiny run's console that may be upstream's and not an error: a handful, for a stray upstream line
# that reaches the terminal another way (a library writing to the file descriptor itself). None were left in a
# 5-step run, where 42 of 53 lines had been SGLang's, Megatron's, fla's and Ray's warnings and info lines.
UPSTREAM_LINES_ALLOWED = 3


def test_tiny_colocated_run_logs_every_phase_and_leaves_no_process(saved_tiny_run):
    records = saved_tiny_run.records
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # 4: the evaluation after the last step
    records = records[:SAVING_RUN_STEPS]
    vocab_size = json.loads((saved_tiny_run.exp_dir / "model" / "config.json").read_text())["vocab_size"]
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
    assert any(name.startswith("events.out.tfevents.") for name in saved_tiny_run.tensorboard_events)
    assert saved_tiny_run.reward_curve_head == b"\x89PNG"
    assert not saved_tiny_run.leftover, f"processes left behind by the run: {saved_tiny_run.leftover}"


def test_the_console_shows_relax_lines_and_run_log_keeps_the_upstream_ones(saved_tiny_run):
    upstream = not_relax_lines(saved_tiny_run.console)
    assert len(upstream) <= UPSTREAM_LINES_ALLOWED, "\n".join(upstream)
    run_log = (saved_tiny_run.exp_dir / "output" / "run.log").read_text()
    # SGLang's warnings (from its scheduler process too) are not lost: they are in the run's log. The scheduler's: its
    # distributed set-up's, on an x86 CPU (SGLang's AMX backend needs sgl_kernel ops relax's stand-in does not serve).
    assert "init_cpu_threads_env and shared memory based AllReduce is disabled" in run_log and "UserWarning" in run_log
    assert f"console log   {saved_tiny_run.exp_dir / 'output' / 'run.log'}" in saved_tiny_run.console


def test_the_engines_evaluate_each_set_at_the_start_every_interval_and_after_the_last_step(saved_tiny_run):
    evaluated = {r["step"]: r for r in saved_tiny_run.records if "perf/eval_time" in r}
    assert list(evaluated) == [0, EVAL_INTERVAL, SAVING_RUN_STEPS]
    faults = {"faults/engine_restarts", "faults/engine_restart_seconds", RUN_RESTARTS}
    assert set(evaluated[SAVING_RUN_STEPS]) == {"step", "perf/eval_time", *faults} | {
        key for key in evaluated[0] if key.startswith("eval/")
    }  # the last evaluation is a row of its own
    assert evaluated[SAVING_RUN_STEPS]["faults/engine_restarts"] == 0
    for step, record in evaluated.items():
        for name in EVAL_SETS:
            pass_at = [record[f"eval/{name}/pass@{k}"] for k in pass_ks(4)]  # the script's 4 samples per prompt
            assert 0.0 <= pass_at[0] and pass_at == sorted(pass_at) and pass_at[-1] <= 1.0, (step, name, pass_at)
            assert 0.0 <= record[f"eval/{name}/reward_mean"] <= 1.0
            assert 1.0 <= record[f"eval/{name}/response_length_mean"] <= 2.0  # at most the rollout's 2 tokens
            assert 0.0 <= record[f"eval/{name}/truncated_fraction"] <= 1.0
    assert not any(key.startswith("eval/") for r in saved_tiny_run.records if r["step"] in (1, 3) for key in r)
