"""A multi-turn rollout with a tool call on SGLang's real in-process engine (CPU, float32, tiny Qwen3 with the
tool-chat tokenizer), token-exact end to end.

A random tiny model never writes a tool call, so the model is first trained (HF transformers, a few dozen steps) to
recite one conversation: a calculator call, then the answer after the tool's result. Greedy decoding then makes the
engine sample that call itself; relax runs the calculator and appends the tool turn; the engine samples the answer.
"""

import asyncio

import pytest
import torch
import transformers

from relax.platform import get_platform
from relax.rollout.engine import RolloutEngine, SamplingConfig
from relax.rollout.multi_turn import generate_multi_turn
from relax.rollout.tools import Calculator
from relax.rollout.turns import ChatTurns
from relax.tools.tiny_model import build_tiny_model

SERVER_ARGS = {"max_total_tokens": 4096}  # a small KV pool, as tests/e2e/test_engine.py explains
QUESTION = [{"role": "user", "content": "12345*6789?"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12345*6789"}}\n</tool_call><|im_end|>'
RESULT = str(12345 * 6789)
ANSWER = RESULT + "<|im_end|>"
MAX_TRAINING_STEPS = 300


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer) -> list[int]:
    return encode(tokenizer, tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True))


def recite(model, sequence: list[int], prompt_length: int) -> None:
    """Train `model` until its greedy choice at every position after the prompt is the next id of `sequence`."""
    ids = torch.tensor([sequence])
    targets = ids[0, prompt_length:]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(MAX_TRAINING_STEPS):
        logits = model(ids).logits[0, prompt_length - 1: -1]
        loss = torch.nn.functional.cross_entropy(logits, targets)
        if loss.item() < 0.05 and bool((logits.argmax(-1) == targets).all()):
            return
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    raise AssertionError(f"the tiny model did not learn the conversation in {MAX_TRAINING_STEPS} steps")


@pytest.fixture(scope="module")
def reciting_model(tmp_path_factory):
    """A tiny model that answers QUESTION with CALL and, after the calculator's result, with ANSWER."""
    directory = build_tiny_model(tmp_path_factory.mktemp("reciting_model"), "qwen3", seed=0, tool_chat=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    prompt, call = prompt_ids(tokenizer), encode(tokenizer, CALL)
    conversation = prompt + call + ChatTurns(tokenizer).after_assistant(call, [RESULT]) + encode(tokenizer, ANSWER)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    recite(model, conversation, len(prompt))
    model.save_pretrained(directory)
    return directory, tokenizer, model.eval()


def test_the_trained_sequence_is_the_prompt_and_the_engines_sampled_ids_and_the_appended_ids(reciting_model):
    directory, tokenizer, model = reciting_model
    prompt = prompt_ids(tokenizer)
    turns = ChatTurns(tokenizer)
    requests = []  # (input ids, the engine's completion) of each turn

    with RolloutEngine(SERVER_ARGS, model_path=str(directory), platform=get_platform("cpu")) as engine:
        async def generate(input_ids, sampling):
            (completion,), = await asyncio.to_thread(engine.generate, [input_ids], sampling)
            requests.append((list(input_ids), completion))
            return completion

        response = asyncio.run(generate_multi_turn(
            generate, prompt, SamplingConfig(temperature=0.0, max_new_tokens=200), turns,
            {"calculator": Calculator()}, max_turns=3,
        ))

    (first_input, first), (second_input, second) = requests
    assert tokenizer.decode(first.token_ids) == CALL and tokenizer.decode(second.token_ids) == ANSWER
    assert (response.finish_reason, response.turns, response.tool_calls, response.tool_failures) == ("stop", 2, 1, 0)
    appended = turns.after_assistant(first.token_ids, [RESULT])
    assert first_input == prompt
    assert second_input == prompt + first.token_ids + appended
    assert response.token_ids == first.token_ids + appended + second.token_ids
    assert response.loss_mask == [1] * len(first.token_ids) + [0] * len(appended) + [1] * len(second.token_ids)
    assert response.logprobs == first.logprobs + [0.0] * len(appended) + second.logprobs

    # The engine sampled each id in exactly this context: the model's log-probabilities of the whole sequence, in one
    # forward pass, are the engine's at every sampled position.
    sequence = prompt + response.token_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([sequence])).logits[0], dim=-1)
    for offset, (token, sampled, engine_logprob) in enumerate(
        zip(response.token_ids, response.loss_mask, response.logprobs)
    ):
        if sampled:
            assert abs(logprobs[len(prompt) + offset - 1, token].item() - engine_logprob) < 1e-4
