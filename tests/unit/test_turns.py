"""ChatTurns on the tool-chat tokenizer (Qwen3's chat format): per template case, the ids appended after an assistant
turn, the proof that every turn's input is the previous turn's input plus what was sampled and appended, and where
re-tokenizing the rendered conversation would give other ids."""

import pytest

from relax.rollout.turns import ChatTurns
from relax.tools.tiny_model import build_tokenizer

CALL_1 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
TOOL_CALLS = [
    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+2"}}},
    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3*4"}}},
]
QUESTION = [{"role": "user", "content": "what is 1+2 and 3*4?"}]


@pytest.fixture(scope="module")
def tokenizer(tool_chat_tokenizer):
    return tool_chat_tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def session(turns: ChatTurns, prompt: list[int], steps: list[tuple[list[int], list[str]]]) -> list[int]:
    """The sequence a rollout builds from `prompt` and, per turn, the ids sampled and the tool outputs (none in the
    last turn), checking that each turn's input starts with the previous turn's input followed by its sampled ids."""
    sequence, previous = list(prompt), None
    for sampled, outputs in steps:
        if previous is not None:
            assert sequence[: len(previous)] == previous
        previous = sequence + sampled
        sequence = previous + (turns.after_assistant(sampled, outputs) if outputs else [])
    return sequence


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y)


def test_the_end_of_turn_is_the_templates_and_the_sampled_eos_is_not_appended_twice(tokenizer):
    turns = ChatTurns(tokenizer)
    assert turns.end_of_turn_ids == encode(tokenizer, "<|im_end|>\n")
    stopped_on_eos = encode(tokenizer, CALL_1 + "<|im_end|>")
    cut_off = encode(tokenizer, CALL_1)  # e.g. stopped on another stop token: the whole end of turn is appended
    tool_turn = "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert turns.after_assistant(stopped_on_eos, ["3"]) == encode(tokenizer, tool_turn)
    assert turns.after_assistant(cut_off, ["3"]) == encode(tokenizer, "<|im_end|>" + tool_turn)


def test_separator_between_turns(tokenizer):
    """The "\\n" after <|im_end|> that the model never samples is appended; rendering the tool message on its own
    (a common shortcut) drops it, and re-rendering the whole conversation drops the empty thinking block that the
    generation prompt put before the first answer."""
    turns = ChatTurns(tokenizer, {"enable_thinking": False})
    prompt = encode(tokenizer, render(tokenizer, QUESTION, add_generation_prompt=True, enable_thinking=False))
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    call = encode(tokenizer, CALL_1 + "<|im_end|>")
    answer = encode(tokenizer, "3<|im_end|>")
    sequence = session(turns, prompt, [(call, ["3"]), (answer, [])])

    appended = sequence[len(prompt) + len(call): -len(answer)]
    assert tokenizer.decode(appended) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    alone = encode(tokenizer, render(tokenizer, [{"role": "tool", "content": "3"}], add_generation_prompt=True,
                                     enable_thinking=False))
    assert appended == encode(tokenizer, "\n") + alone  # the shortcut loses the separator

    messages = QUESTION + [{"role": "assistant", "content": "", "tool_calls": TOOL_CALLS[:1]},
                           {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]
    rendered = encode(tokenizer, render(tokenizer, messages, enable_thinking=False))
    where = first_difference(sequence, rendered)
    assert where == len(prompt) - len(encode(tokenizer, "<think>\n\n</think>\n\n"))
    assert tokenizer.decode(rendered[where:]).startswith(CALL_1)  # the first answer lost its empty thinking block


def test_two_consecutive_tool_messages_share_one_user_turn(tokenizer):
    """Two calls in one turn, their two results merged into one user turn as the template merges them; here the
    model wrote exactly what the template writes, so the sequence is also the rendered conversation's ids."""
    turns = ChatTurns(tokenizer)
    prompt = encode(tokenizer, render(tokenizer, QUESTION, add_generation_prompt=True))
    calls = encode(tokenizer, CALL_1 + "\n" + CALL_2 + "<|im_end|>")
    answer = encode(tokenizer, "3 and 12<|im_end|>")
    sequence = session(turns, prompt, [(calls, ["3", "12"]), (answer, [])])

    appended = sequence[len(prompt) + len(calls): -len(answer)]
    assert tokenizer.decode(appended) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n12\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    one_by_one = [encode(tokenizer, render(tokenizer, [{"role": "tool", "content": text}])) for text in ("3", "12")]
    header = encode(tokenizer, "<|im_start|>assistant\n")
    assert appended != encode(tokenizer, "\n") + one_by_one[0] + one_by_one[1] + header
    messages = QUESTION + [{"role": "assistant", "content": "", "tool_calls": TOOL_CALLS},
                           {"role": "tool", "content": "3"}, {"role": "tool", "content": "12"}]
    assert sequence[: -len(answer)] == encode(tokenizer, render(tokenizer, messages, add_generation_prompt=True))


def test_several_calls_in_the_models_own_json_spacing(tokenizer):
    """The model wrote its calls without spaces; the template re-renders parsed calls with json spacing: the
    sequence keeps the sampled ids, a re-render would train other ids than the engine sampled."""
    turns = ChatTurns(tokenizer)
    prompt = encode(tokenizer, render(tokenizer, QUESTION, add_generation_prompt=True))
    compact = [call.replace('": ', '":').replace(', "', ',"') for call in (CALL_1, CALL_2)]
    calls = encode(tokenizer, compact[0] + "\n" + compact[1] + "<|im_end|>")
    answer = encode(tokenizer, "3 and 12<|im_end|>")
    sequence = session(turns, prompt, [(calls, ["3", "12"]), (answer, [])])
    assert sequence[len(prompt): len(prompt) + len(calls)] == calls

    messages = QUESTION + [{"role": "assistant", "content": "", "tool_calls": TOOL_CALLS},
                           {"role": "tool", "content": "3"}, {"role": "tool", "content": "12"},
                           {"role": "assistant", "content": "3 and 12"}]
    rendered = encode(tokenizer, render(tokenizer, messages))
    where = first_difference(sequence, rendered)
    assert tokenizer.decode(sequence[len(prompt): where]) == '<tool_call>\n{"name":'
    assert len(rendered) != len(sequence)


def test_a_thinking_block_is_kept_as_sampled(tokenizer):
    """The model thought, sampling "\\n" "\\n" as two ids where the tokenizer has one for "\\n\\n", and called a tool;
    its second turn thinks again. Re-rendering normalises the block (a "\\n" before </think>) and re-tokenizing
    merges the newlines: both change ids the engine sampled."""
    turns = ChatTurns(tokenizer)
    prompt = encode(tokenizer, render(tokenizer, QUESTION, add_generation_prompt=True))
    newline = encode(tokenizer, "\n")
    thought = encode(tokenizer, "<think>\nadd them</think>") + newline + newline
    first = thought + encode(tokenizer, CALL_1 + "<|im_end|>")
    second = encode(tokenizer, "<think>\ndone</think>\n\n3<|im_end|>")
    sequence = session(turns, prompt, [(first, ["3"]), (second, [])])
    assert sequence[len(prompt): len(prompt) + len(first)] == first
    assert tokenizer.decode(sequence[len(prompt) + len(first): -len(second)]) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )

    messages = QUESTION + [
        {"role": "assistant", "content": "<think>\nadd them</think>\n\n", "tool_calls": TOOL_CALLS[:1]},
        {"role": "tool", "content": "3"}, {"role": "assistant", "content": "<think>\ndone</think>\n\n3"},
    ]
    rendered_text = render(tokenizer, messages)
    assert "<think>\nadd them\n</think>\n\n" in rendered_text  # the template's normal form, not what was sampled
    rendered = encode(tokenizer, rendered_text)
    assert tokenizer.decode(sequence[first_difference(sequence, rendered) - 1:]).startswith("m</think>")
    retokenized = encode(tokenizer, tokenizer.decode(sequence))  # even without re-rendering: "\n\n" merges
    assert retokenized != sequence and len(retokenized) == len(sequence) - 1


def test_a_template_that_writes_no_content_marker_is_refused(tmp_path):
    tokenizer = build_tokenizer(tmp_path)
    tokenizer.chat_template = "{% for message in messages %}{{ message.role }}{% endfor %}"
    with pytest.raises(ValueError, match="does not write an assistant's content"):
        ChatTurns(tokenizer)
