"""What a run reads before any worker starts (relax.run.inputs), as `relax train --dry-run` reads it: the reward
function is imported there, for a run that generates and for one that replays rollouts and evaluates; the longest
prompt with its response budget is checked against the model's context length, or each prompt's budget clipped to
it. The prompt data, eval sets, checkpoint and rollout data: tests/unit/test_cli_data.py; the earlier record:
tests/unit/test_metrics.py."""

import pytest

from helpers import write_jsonl
from relax.args import parse_train_args
from relax.rollout.engine import request_params
from relax.run.inputs import InputError, read_inputs

SIZE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
BASE = ["--lr", "1e-6", "--device", "cpu", "--dry-run", *SIZE]
GENERATING = [*BASE, "--prompt-data", "prompts.jsonl"]
REPLAYING_AND_EVALUATING = [
    *BASE, "--load-rollout-data", "rollouts/{step}.jsonl", "--eval-prompt-data", "held_out", "h.jsonl",
]


@pytest.mark.parametrize("argv", [GENERATING, REPLAYING_AND_EVALUATING], ids=["generating", "replaying, evaluating"])
def test_a_reward_function_that_does_not_import_is_refused_before_the_run(argv, tmp_path):
    config = parse_train_args([*argv, "--output-dir", str(tmp_path), "--reward-fn", "relax_no_such_module:score"])
    with pytest.raises(InputError) as refused:
        read_inputs(config, dry_run=True)
    assert "--reward-fn relax_no_such_module:score: cannot import module 'relax_no_such_module'" in str(refused.value)


def test_the_reward_function_read_is_the_one_the_run_calls(tmp_path):
    config = parse_train_args([*GENERATING, "--output-dir", str(tmp_path), "--reward-fn", "math"])
    assert read_inputs(config, dry_run=True).reward_fn.name == "math"


# The tiny model's tokenizer has one token per character; its config.json's max_position_embeddings is 512.
SHORT, LONG = "a" * 10, "a" * 100  # prompts of 10 and 100 tokens (no chat template)


def tiny_run(tmp_path, checkpoint, *extra) -> list[str]:
    """A generating run of the tiny model on a prompt of 10 tokens (row 1) and one of 100 (row 2)."""
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": SHORT, "label": "1"}, {"prompt": LONG, "label": "2"}])
    return ["--lr", "1e-6", "--device", "cpu", "--dry-run", "--hf-checkpoint", str(checkpoint), "--reward-fn", "math",
            "--prompt-data", str(data), "--output-dir", str(tmp_path / "out"), *extra]


def test_a_prompt_and_response_budget_past_the_context_length_are_refused_naming_them(tmp_path, tiny_qwen3):
    config = parse_train_args(tiny_run(tmp_path, tiny_qwen3, "--rollout-max-response-len", "480"))
    with pytest.raises(InputError) as refused:
        read_inputs(config, dry_run=True)
    assert str(refused.value) == (
        f"--prompt-data {tmp_path / 'prompts.jsonl'}: the longest prompt (row 2) has 100 tokens; with "
        "--rollout-max-response-len 480 its requests need 580 tokens, more than the model's context length of 512 "
        f"tokens ({tiny_qwen3 / 'config.json'} max_position_embeddings): shorten the prompts (--max-prompt-length 32 "
        "drops longer ones), lower --rollout-max-response-len to 412, or pass --rollout-clip-response-to-context to "
        "give such prompts the response budget the context leaves them"
    )
    config = parse_train_args(tiny_run(tmp_path, tiny_qwen3, "--rollout-max-response-len", "412"))
    assert read_inputs(config, dry_run=True).prompts[1].row == 2  # fits exactly: prompt + response = 512


def test_the_smaller_sglang_context_length_is_the_limit(tmp_path, tiny_qwen3):
    argv = tiny_run(tmp_path, tiny_qwen3, "--rollout-max-response-len", "8", "--sglang-context-length", "64")
    with pytest.raises(InputError, match=r"row 2\) has 100 tokens, which leaves no room for a response within the "
                       r"model's context length of 64 tokens \(--sglang-context-length\): shorten such prompts, or "
                       r"drop them with --max-prompt-length 63 or less"):
        read_inputs(parse_train_args(argv), dry_run=True)
    argv = tiny_run(tmp_path, tiny_qwen3, "--rollout-max-response-len", "8", "--sglang-context-length", "1024")
    assert read_inputs(parse_train_args(argv), dry_run=True).prompts  # the config's 512 is the limit: it fits


def test_a_prompt_that_fills_the_context_alone_is_refused_even_when_clipping(tmp_path, tiny_qwen3):
    argv = tiny_run(tmp_path, tiny_qwen3, "--sglang-context-length", "100", "--rollout-clip-response-to-context")
    with pytest.raises(InputError, match=r"the longest prompt \(row 2\) has 100 tokens, which leaves no room"):
        read_inputs(parse_train_args(argv), dry_run=True)


def test_clipping_gives_each_prompt_the_budget_its_context_leaves_and_says_so(tmp_path, tiny_qwen3):
    argv = tiny_run(tmp_path, tiny_qwen3, "--rollout-max-response-len", "480", "--rollout-clip-response-to-context")
    config = parse_train_args([*argv, "--n-samples-per-prompt", "2"])
    inputs = read_inputs(config, dry_run=True)
    assert (
        "prompt data: 1 of 2 prompts respond in fewer than --rollout-max-response-len 480 tokens, clipped to the "
        f"model's context length of 512 tokens ({tiny_qwen3 / 'config.json'} max_position_embeddings) "
        "(--rollout-clip-response-to-context); the smallest budget 412 tokens (row 2)"
    ) in inputs.report
    # What the engine asks SGLang for, each prompt's requests (n = 2 each): the short one keeps the whole budget.
    requests = [prompt.token_ids for prompt in inputs.prompts for _ in range(2)]
    params = request_params(requests, config.rollout.sampling)
    assert [p["max_new_tokens"] for p in params] == [480, 480, 412, 412]


def test_each_eval_set_is_checked_with_its_own_response_budget(tmp_path, tiny_qwen3):
    held_out = write_jsonl(tmp_path / "held_out.jsonl", [{"prompt": LONG, "label": "2"}])
    argv = tiny_run(tmp_path, tiny_qwen3, "--rollout-max-response-len", "8", "--eval-prompt-data", "held_out",
                    str(held_out))
    with pytest.raises(InputError) as refused:
        read_inputs(parse_train_args([*argv, "--eval-max-response-len", "500"]), dry_run=True)
    assert str(refused.value).startswith(
        f"--eval-prompt-data held_out {held_out}: the longest prompt (row 1) has 100 tokens; with "
        "--eval-max-response-len 500 its requests need 600 tokens"
    )
    config = parse_train_args([*argv, "--eval-max-response-len", "500", "--rollout-clip-response-to-context"])
    inputs = read_inputs(config, dry_run=True)
    assert any(line.startswith("eval set held_out: 1 of 1 prompts respond in fewer than --eval-max-response-len 500")
               for line in inputs.report)
    (eval_set,) = inputs.eval_sets
    params = request_params([eval_set.prompts[0].token_ids], config.evaluation.sampling)
    assert params[0]["max_new_tokens"] == 412


def test_the_report_says_where_the_users_decode_graphs_stop_below_an_engines_batch(tmp_path):
    """64 prompts x 8 samples on one GPU engine: 512 requests at once."""
    run = ["--lr", "1e-6", "--device", "cuda", "--dry-run", *SIZE, "--prompt-data", "prompts.jsonl",
           "--reward-fn", "math", "--output-dir", str(tmp_path), "--rollout-batch-size", "64",
           "--n-samples-per-prompt", "8"]

    def graph_lines(*flags):
        report = read_inputs(parse_train_args([*run, *flags]), dry_run=True).report
        return [line for line in report if line.startswith("decode graphs:")]

    assert graph_lines("--sglang-cuda-graph-max-bs-decode", "256") == [
        "decode graphs: the sizes given (--sglang-cuda-graph-max-bs-decode, --sglang-cuda-graph-bs-decode or "
        "--sglang-cuda-graph-config) stop at 256 requests, while an engine runs up to 512 at once in a rollout: "
        "decode steps of larger batches run without a graph (without those flags relax sizes the graphs to the "
        "rollout)"
    ]
    assert graph_lines() == []  # relax's own sizes cover the batch
    assert graph_lines("--sglang-cuda-graph-bs-decode", "8", "512") == []
    # the engine never runs more than 256 at once
    assert graph_lines("--sglang-cuda-graph-max-bs-decode", "256", "--sglang-max-running-requests", "256") == []
    assert graph_lines("--sglang-cuda-graph-max-bs-decode", "256", "--sglang-disable-decode-cuda-graph") == []
