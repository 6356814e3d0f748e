"""The calculator task: its rows and exact-answer reward (relax.rollout.synthetic's multiply) and the warm start's
demonstrations (relax.tools.tool_task), checked against what a multi-turn rollout sends, parses and decodes."""

import json

import pytest
import torch
import transformers

from relax.rollout.data import PromptDataConfig, load_prompts
from relax.rollout.rewards import RewardInput, load_reward_fn, score
from relax.rollout.synthetic import MULTIPLY_OPERANDS, final_answer, write_task
from relax.rollout.tool_calls import parse_tool_calls
from relax.rollout.tools import Calculator, tool_schema
from relax.rollout.turns import ChatTurns
from relax.tools.tiny_model import build_tiny_model
from relax.tools.tool_task import demonstration, warm_start


def test_multiply_rows_have_two_digit_operands_and_a_four_digit_product(tmp_path):
    rows = [json.loads(line) for line in write_task("multiply", 200, tmp_path / "m.jsonl").read_text().splitlines()]
    for row in rows:
        a, b = map(int, row["prompt"].split("*"))
        assert a in MULTIPLY_OPERANDS and b in MULTIPLY_OPERANDS and row["label"] == str(a * b)
        assert len(row["label"]) == 4
    assert len({row["prompt"] for row in rows}) > 150


def test_the_multiply_reward_is_the_exact_product_on_the_last_line():
    assert final_answer(" x\nassistant\n2146 \n") == "2146"
    responses = ["2146", "\n{\"name\": \"calculator\"}\nuser\n\n2146\n\nassistant\n2146", "2147", "21460",
                 "\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"37*58\"}}\n", ""]
    scores, failed, _ = score(load_reward_fn("multiply"),
                              [RewardInput(prompt="37*58", response=r, label="2146") for r in responses])
    assert scores == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0] and not any(failed)


def test_a_demonstration_is_the_rollouts_prompt_call_tool_turn_and_answer(tmp_path, tool_chat_tokenizer):
    tokenizer, turns = tool_chat_tokenizer, ChatTurns(tool_chat_tokenizer)
    row = {"prompt": "37*58", "label": "2146"}
    data = tmp_path / "m.jsonl"
    data.write_text(json.dumps(row) + "\n")
    (prompt,), _ = load_prompts(PromptDataConfig(str(data), tools=(tool_schema(Calculator()),)), tokenizer)

    ids, mask = demonstration(tokenizer, turns, row, use_tool=True)
    assert len(ids) == len(mask) and ids[:len(prompt.token_ids)] == prompt.token_ids
    response, response_mask = ids[len(prompt.token_ids):], mask[len(prompt.token_ids):]
    assert not any(mask[:len(prompt.token_ids)]) and response_mask[0] == 1
    call_length = response_mask.index(0)
    call = response[:call_length]
    (parsed,) = parse_tool_calls(tokenizer.decode(call, skip_special_tokens=False))
    assert (parsed.name, parsed.arguments) == ("calculator", {"expression": "37*58"})
    appended = turns.after_assistant(call, ["2146"])
    assert response[call_length:call_length + len(appended)] == appended
    answer_length = len(response) - call_length - len(appended)
    assert response_mask == [1] * call_length + [0] * len(appended) + [1] * answer_length
    # the reward reads the answer from the response as the rollout decodes it
    text = tokenizer.decode(response, skip_special_tokens=True)
    assert score(load_reward_fn("multiply"), [RewardInput(prompt="", response=text, label="2146")])[0] == [1.0]

    direct, direct_mask = demonstration(tokenizer, turns, row, use_tool=False)
    assert direct[:len(prompt.token_ids)] == prompt.token_ids
    assert tokenizer.decode(direct[len(prompt.token_ids):], skip_special_tokens=False) == "2146<|im_end|>"
    assert direct_mask == [0] * len(prompt.token_ids) + [1] * (len(direct) - len(prompt.token_ids))


def test_the_warm_start_is_deterministic_and_lowers_the_loss(tmp_path):
    torch.set_num_threads(1)
    directory = build_tiny_model(tmp_path / "model", "qwen3", seed=0, tool_chat=True, max_position_embeddings=1024)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)

    def losses(steps):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        return warm_start(model, tokenizer, steps, batch_size=2, lr=1e-2, direct_share=0.5, seed=0)

    first = losses(10)
    assert first[-1] < first[0] - 1.0  # from a random model's ln(vocabulary) towards the format's few choices
    assert losses(10) == pytest.approx(first, abs=1e-6)
