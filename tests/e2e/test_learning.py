"""The tiny job (scripts/run-tiny-cpu.sh: 80 steps of the copy-digit task) learns: the mean reward of its last 20
steps reaches 0.9, colocated and in each off-policy rollout mode. Minutes per run on 2 cores (the colocated one in
CI's run added 9 minutes to it, beside the other lane), so these are not in the default run (pytest.ini's
`-m "not learning and not long"`): `.venv/bin/python -m pytest -m learning -n 3 tests/e2e/test_learning.py`.

The colocated job, the README's, runs with `--sglang-enable-deterministic-inference`: SGLang then honours the
per-request sampling seeds, so one machine runs the same trajectory every time (eight seeds learned:
docs/benchmarks.md, "Colocated loop on CPU"). The off-policy modes depend on the processes' timing (which groups a
step trains) whatever the seeds. Their figures over several seeds are in docs/benchmarks.md ("Partial rollout on
CPU", "Separate devices on CPU")."""

import pytest

from tiny_runs import run_tiny_job, step_records

pytestmark = [pytest.mark.learning, pytest.mark.timeout(1800)]
LAST_STEPS = 20
FINAL_REWARD = 0.9
OFF_POLICY_MODES = {
    # 32 groups in flight for the 16 a step trains on; the aborted ones continue in the next step, so nearly every
    # batch is the previous step's surplus, one step old
    "partial rollout": ["--over-sampling-batch-size", "32", "--partial-rollout", "--seed", "1"],
    # the engine on a Ray bundle of its own, one step off-policy
    "async": ["--no-colocate", "--rollout-num-gpus", "1", "--seed", "2"],
}


def assert_learned(mode: str, records: list[dict]) -> None:
    steps = step_records(records)
    assert len(steps) == 80
    final = sum(r["rollout/reward_mean"] for r in steps[-LAST_STEPS:]) / LAST_STEPS
    assert final >= FINAL_REWARD, f"{mode}: mean reward {final:.3f} over the last {LAST_STEPS} steps"


def test_the_readme_job_learns(tmp_path):
    assert_learned("colocated", run_tiny_job(tmp_path, "--sglang-enable-deterministic-inference"))


@pytest.mark.parametrize("mode", OFF_POLICY_MODES)
def test_the_tiny_task_is_learned_off_policy(mode, tmp_path):
    assert_learned(mode, run_tiny_job(tmp_path, *OFF_POLICY_MODES[mode]))
