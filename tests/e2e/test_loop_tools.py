"""Multi-turn tool use through the real loop on CPU (scripts/run-tiny-cpu.sh with --tools calculator): the engine
actor runs each sample's turns, a tool call's output comes back as the chat template's tool turn, the step's row
counts turns and calls, and the step trains on the samples with the appended ids masked out of the loss.

The run over-samples with partial rollout, over two steps: the groups step 0 does not need go back with what their
samples generated, and step 1 continues them where they stopped (how many were cut mid-turn or between turns
depends on timing: tests/unit/test_multi_turn.py continues each case against the uninterrupted run).

The random tiny tool-chat model writes <tool_call> (one token of its ~100) now and then, rarely a well-formed call;
a malformed one is still a call, answered with its error in the tool turn. Whether any sample of the run called is
chance, so the test checks what holds either way: every run of masked ids in a saved sample is exactly what relax
appends after the turn before it (ChatTurns, for that turn's calls), and with one turn per sample nothing is masked.
The model's context is raised from the tiny 512 so that a response fits beside the prompt's tool descriptions."""

import asyncio
import json
from pathlib import Path

import pytest
import transformers

from relax.rollout.dump import rollout_data_path
from relax.rollout.tool_calls import parse_tool_calls, run_tool_calls
from relax.rollout.tools import Calculator
from relax.rollout.turns import ChatTurns
from relax.tools.tiny_model import build_tiny_model
from tiny_runs import run_tiny_job, step_records

pytestmark = pytest.mark.long  # pytest.ini: not in CI's run

TOOL_METRICS = ("rollout/turns_mean", "rollout/tool_calls", "rollout/tool_failures", "rollout/tool_timeouts",
                "rollout/masked_token_share")


def test_a_run_with_the_calculator_trains_on_multi_turn_samples_with_the_tool_turns_masked(tmp_path):
    model = build_tiny_model(tmp_path / "tool_chat_model", "qwen3", seed=0, tool_chat=True,
                             max_position_embeddings=1024)
    pattern = str(tmp_path / "rollouts" / "step_{step}.jsonl")
    records = step_records(run_tiny_job(
        tmp_path, "--num-steps", "2", "--apply-chat-template", "--tools", "calculator", "--max-turns", "3",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--micro-batch-size", "8", "--rollout-max-response-len", "160", "--eval-max-response-len", "4",
        "--over-sampling-batch-size", "4", "--partial-rollout", "--save-rollout-data", pattern,
        env={"TINY_MODEL_DIR": str(model)},
    ))
    assert [record["step"] for record in records] == [0, 1]
    # step 0 put back the 2 groups it did not need, with what they generated; step 1 continued them
    assert records[0]["rollout/returned_prompts"] == 2 and records[1]["rollout/partial_resumed_samples"] > 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    for step, record in enumerate(records):
        _check_step(record, rollout_data_path(pattern, step), tokenizer)


def _check_step(record: dict, rollout_data: Path, tokenizer):
    """A step's record and saved samples (continued ones too): every masked run is what relax appends after the
    whole turn before it."""
    assert record["train/update_successful"] == 1.0
    for key in TOOL_METRICS:
        assert key in record, f"the step lacks {key}"
    assert record["rollout/turns_mean"] >= 1 and record["rollout/tool_timeouts"] == 0

    turns, calculator = ChatTurns(tokenizer), {"calculator": Calculator()}
    groups = [json.loads(line) for line in rollout_data.read_text().splitlines()[1:]]
    samples = [sample for group in groups for sample in group["samples"]]
    assert len(samples) == 8
    masked = 0
    for sample in samples:
        ids, mask = sample["response_token_ids"], sample["loss_mask"]
        assert len(mask) == len(ids) and mask[:1] == [1]
        # Turns of sampled ids (mask 1), each but the last followed by the ids relax appended (mask 0): the end of the
        # turn, the tool turn with the calculator's output for that turn's calls, the next assistant header.
        runs = _runs(mask)
        for (start, end, sampled), (_, after, _) in zip(runs, runs[1:]):
            if sampled:
                turn = ids[start:end]
                calls = parse_tool_calls(tokenizer.decode(turn, skip_special_tokens=False))
                outputs = asyncio.run(run_tool_calls(calls, calculator))
                assert outputs, "ids were appended after a turn without a tool call"
                assert ids[end:after] == turns.after_assistant(turn, [output.text for output in outputs])
                masked += after - end
    if record["rollout/turns_mean"] == 1:
        assert masked == 0
    total = sum(len(sample["loss_mask"]) for sample in samples)
    assert record["rollout/masked_token_share"] == pytest.approx(masked / total)
    # each turn is one run of sampled ids, a turn cut by an abort and continued included: counted once
    sampled_runs = sum(value for sample in samples for _, _, value in _runs(sample["loss_mask"]))
    assert record["rollout/turns_mean"] == pytest.approx(sampled_runs / len(samples))


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) of each run of equal values in `mask`."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs
