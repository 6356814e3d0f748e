"""Over-sampling on the tiny CPU run (scripts/run-tiny-cpu.sh): each step submits --over-sampling-batch-size 16
prompts for --rollout-batch-size 8 groups, trains on the first 8 to complete, aborts the others through SGLang's
abort and puts their prompts back into the stream (relax.rollout.rollout.collect_groups); the run completes. The
engine runs one group (8 requests) at a time, so that groups still wait in its queue when the batch is full.

With --partial-rollout and responses of up to 48 tokens, the groups in flight when the batch is full have tokens
(or are complete), which go back with their prompts; the next step takes them first and continues what they began
(how many were cut short mid-response depends on timing: tests/e2e/test_engine.py shows the engine continuing
a response as the uninterrupted request would, tests/unit/test_rollout_driver.py the rollout's bookkeeping)."""

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


def test_partial_rollout_continues_the_aborted_responses_in_the_next_step(tmp_path):
    pattern = str(tmp_path / "rollouts" / "step_{step}.jsonl")
    records = step_records(run_tiny_job(
        tmp_path, "--num-steps", str(NUM_STEPS), "--over-sampling-batch-size", "16", "--save-rollout-data", pattern,
        "--rollout-max-response-len", "48", "--partial-rollout", "--max-staleness", "1",
    ))
    assert [r["step"] for r in records] == list(range(NUM_STEPS))
    first, second = records
    assert first["rollout/returned_prompts"] == 8 and first["rollout/partial_carried_tokens"] > 0, first
    assert first["rollout/partial_resumed_samples"] == 0 and first["rollout/partial_oldest_token_age"] == 0
    # The carried groups come first in the next step. Whether they complete before 8 others (they had a head start)
    # or are cut short again, with more tokens, depends on the engine's timing; nothing is lost either way.
    assert second["rollout/partial_stale_samples"] == 0  # one step old: within --max-staleness
    if second["rollout/partial_resumed_samples"]:
        assert second["rollout/partial_oldest_token_age"] == 1 and second["rollout/partial_old_token_fraction"] > 0
    else:
        assert second["rollout/partial_carried_tokens"] > 0, second
    assert second["train/update_successful"] == 1.0 and "mismatch/logprob_abs_diff_mean" in second
    groups = [json.loads(line) for line in rollout_data_path(pattern, 1).read_text().splitlines()[1:]]
    assert len({group["prompt"]["row"] for group in groups}) == 8  # a full batch, no prompt twice in a step
