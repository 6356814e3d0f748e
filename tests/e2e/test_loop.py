"""The colocated loop end to end on CPU: the README's main job (scripts/run-tiny-cpu.sh), shortened to a few
steps, through the real stack (local Ray, SGLang engine actor, Megatron training actor). The run is the session's
saved_tiny_run (tests/e2e/conftest.py), which test_loop_resume resumes. A second run into the same experiment
directory replaces the first one's record: tests/e2e/test_loop_debug.py checks that on its rollout-only run."""

import json
import math

from tiny_runs import PERF_KEYS, not_relax_lines

# Lines of the tiny run's console that may be upstream's and not an error: a handful, for a stray upstream line
# that reaches the terminal another way (a library writing to the file descriptor itself). None were left in a
# 5-step run, where 42 of 53 lines had been SGLang's, Megatron's, fla's and Ray's warnings and info lines.
UPSTREAM_LINES_ALLOWED = 3


def test_tiny_colocated_run_logs_every_phase_and_leaves_no_process(saved_tiny_run):
    records = saved_tiny_run.records
    assert [r["step"] for r in records] == [0, 1, 2, 3]
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
    # SGLang's warnings (from its scheduler process too) are not lost: they are in the run's log.
    assert "Ignore import error when loading" in run_log and "UserWarning" in run_log
    assert f"console log   {saved_tiny_run.exp_dir / 'output' / 'run.log'}" in saved_tiny_run.console
