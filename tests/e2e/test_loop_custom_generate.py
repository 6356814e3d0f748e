"""A custom generate function (--custom-generate-function-path) through the real loop on CPU (scripts/run-tiny-cpu.sh):
tests/e2e/two_turn_generate.py's two turns around a masked "tool" text run in the engine actor, the saved samples
carry the mask and the engine's logprobs (0.0 where masked), the step trains on them, and the step's failed and
ABORTED samples are counted; the evaluations sample through the function too (one turn each)."""

import json
import os

from relax.rollout.dump import rollout_data_path
from tiny_runs import ROOT, run_tiny_job, step_records
from two_turn_generate import FIRST_TURN_TOKENS, tool_ids

N = 4  # samples per prompt


def test_a_run_trains_on_the_functions_two_turn_samples_with_the_tool_text_masked(tmp_path):
    pattern = str(tmp_path / "rollouts" / "step_{step}.jsonl")
    python_path = os.pathsep.join(filter(None, [str(ROOT / "tests" / "e2e"), os.environ.get("PYTHONPATH")]))
    all_records = run_tiny_job(
        tmp_path, "--num-steps", "2", "--custom-generate-function-path", "two_turn_generate.two_turns",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", str(N), "--global-batch-size", "8",
        "--micro-batch-size", "8", "--rollout-max-response-len", "8", "--eval-max-response-len", "2",
        "--save-rollout-data", pattern,
        env={"PYTHONPATH": python_path},
    )
    records = step_records(all_records)
    assert len(records) == 2
    evaluations = [r for r in all_records if "eval/held_out/reward_mean" in r]
    assert [r["step"] for r in evaluations] == [0, 2]
    assert all(r["eval/held_out/failed_samples"] == 0 for r in evaluations), evaluations
    for record in records:
        assert record["train/update_successful"] == 1.0
        # each step: the first group failed (generated anew from another prompt), the second came back ABORTED
        assert record["rollout/failed_samples"] == N and record["rollout/failed_groups"] == 1, record
        assert record["rollout/function_aborted_samples"] == N, record

    tool = tool_ids(str(tmp_path / "model"))
    for step in range(2):
        groups = [json.loads(line) for line in rollout_data_path(pattern, step).read_text().splitlines()[1:]]
        samples = [sample for group in groups for sample in group["samples"]]
        assert len(samples) == 2 * N
        for sample in samples:
            ids, mask, logprobs = sample["response_token_ids"], sample["loss_mask"], sample["response_logprobs"]
            first = mask.index(0)  # the first turn's tokens, then the tool text, then the second turn's
            assert 1 <= first <= FIRST_TURN_TOKENS and len(ids) <= 8
            assert ids[first:first + len(tool)] == tool
            assert mask == [1] * first + [0] * len(tool) + [1] * (len(ids) - first - len(tool))
            assert logprobs[first:first + len(tool)] == [0.0] * len(tool)
            assert all(value < 0.0 for value, trained in zip(logprobs, mask) if trained)
