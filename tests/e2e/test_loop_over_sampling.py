"""Over-sampling on the tiny CPU run (scripts/run-tiny-cpu.sh): each step submits --over-sampling-batch-size 16
prompts for --rollout-batch-size 8 groups, trains on the first 8 to complete, aborts the others through SGLang's
abort and puts their prompts back into the stream (relax.rollout.rollout.collect_groups); the run completes. The
engine runs one group (8 requests) at a time, so that groups still wait in its queue when the batch is full.

Partial rollout (the aborted groups' responses carried into the next step): tests/e2e/test_loop_signals.py, on the
run it stops with SIGTERM."""

import json

from relax.rollout.dump import rollout_data_path
from tiny_runs import PERF_KEYS, run_tiny_job, step_records

NUM_STEPS = 2


def test_over_sampling_trains_on_the_first_groups_and_puts_the_aborted_ones_back(tmp_path):
    pattern = str(tmp_path / "rollouts" / "step_{step}.jsonl")
    records = step_records(run_tiny_job(
        tmp_path, "--num-steps", str(NUM_STEPS), "--over-sampling-batch-size", "16", "--save-rollout-data", pattern,
        "--sglang-max-running-requests", "8", "--rollout-max-response-len", "8",
    ))
    assert [r["step"] for r in records] == list(range(NUM_STEPS))
    for record in records:
        for key in (*PERF_KEYS, "rollout/reward_mean", "train/loss"):
            assert key in record, f"step {record['step']} lacks {key}"
        assert record["train/update_successful"] == 1.0
        # 16 in flight for 8 groups: the 8 still running once 8 were in were aborted and put back
        assert record["rollout/submitted_groups"] == 16 and record["rollout/returned_prompts"] == 8, record
        assert 0 <= record["rollout/aborted_groups"] <= 8 and record["rollout/failed_groups"] == 0
    assert sum(record["rollout/aborted_groups"] for record in records) > 0  # cut short in the engine's queue
    for step in range(NUM_STEPS):
        groups = [json.loads(line) for line in rollout_data_path(pattern, step).read_text().splitlines()[1:]]
        rows = [group["prompt"]["row"] for group in groups]
        assert len(rows) == 8 and len(set(rows)) == 8  # a full batch, no prompt twice in a step

