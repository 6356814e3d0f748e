"""Synthetic tasks for the tiny CPU demo, with a verifiable reward in [0, 1].

Both use only characters of relax.tools.tiny_model's alphabet (one token per character):

- copy_digit: "copy 1:" -> "1"        (attend to one prompt position; digits from COPY_DIGITS)
- reverse3:   "reverse abc:" -> "cba" (three positional copies in reverse order; the harder one)
- multiply:   "37*58" -> "2146"   (two 2-digit numbers: beyond a tiny model's head, a calculator call away; for the
                                   tool-chat tokenizer, whose alphabet is printable ASCII; relax.tools.tool_task)

What a tiny random Qwen3 (relax.tools.tiny_model, ~80k parameters) learned in a probe with plain GRPO (HF
generate + a torch policy-gradient step, 8 prompts x 8 samples per step, AdamW lr 1e-2, up to 4 new
tokens, temperature 1): copy_digit over the digits 0-1 went from a mean reward of 0.03 to 0.67 in 60
steps (the first character right in most samples); over 0-3 it stayed between 0.2 and 0.5, and over 0-9
between 0.1 and 0.2 (digits, but not the right one). It never learned to stop (EOS) in that time, so responses
run to the token limit. Hence COPY_DIGITS = "01". reverse3 was not shown to learn in a few dozen steps.

The reward (shaped_score) is shaped so that a random policy earns some of it and each step towards the
answer earns more: 0.5 if the first character is right + 0.3 x positional character agreement (positions
where response and answer agree, divided by the longer length, so junk after the answer costs) + 0.1 if
the length is right + 0.1 x the share of response characters from the answer's alphabet. An exact answer
scores 1. Plain agreement alone was too sparse: in the probe the copy_digit reward stayed near 0.

Write a task's prompts with:
    python -m relax.rollout.synthetic --task copy_digit --num-rows 2000 --out data/copy_digit.jsonl
"""

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

COPY_DIGITS = "01"  # see the module docstring: a wider set is not learned in a few dozen steps
REVERSE_LETTERS = "abcdefgh"  # a small set keeps the task inside a tiny model's reach
# multiply's operands: two digits each, at least 32 so that every product has four digits and every conversation
# the same length (the call and the answer copy digits from fixed offsets)
MULTIPLY_OPERANDS = range(32, 100)


def char_match_score(response: str, answer: str) -> float:
    response = response.strip()
    if not response:
        return 0.0
    matches = sum(a == b for a, b in zip(response, answer))
    return matches / max(len(response), len(answer))


def _copy_digit_row(rng: random.Random) -> dict:
    digit = rng.choice(COPY_DIGITS)
    return {"prompt": f"copy {digit}:", "label": digit}


def _reverse3_row(rng: random.Random) -> dict:
    letters = "".join(rng.choice(REVERSE_LETTERS) for _ in range(3))
    return {"prompt": f"reverse {letters}:", "label": letters[::-1]}


def multiply_row(rng: random.Random) -> dict:
    a, b = rng.choice(MULTIPLY_OPERANDS), rng.choice(MULTIPLY_OPERANDS)
    return {"prompt": f"{a}*{b}", "label": str(a * b)}


def shaped_score(response: str, answer: str, alphabet: str) -> float:
    """0.8 x char_match_score + 0.1 x right length + 0.1 x share of characters from `alphabet`; in [0, 1]."""
    response = response.strip()
    in_alphabet = sum(c in alphabet for c in response) / len(response) if response else 0.0
    first_right = bool(response) and response[0] == answer[0]
    return (
        0.5 * first_right
        + 0.3 * char_match_score(response, answer)
        + 0.1 * (len(response) == len(answer))
        + 0.1 * in_alphabet
    )


def copy_digit_reward(sample) -> float:
    return shaped_score(sample.response, str(sample.label), COPY_DIGITS)


def reverse3_reward(sample) -> float:
    return shaped_score(sample.response, str(sample.label), REVERSE_LETTERS)


def final_answer(response: str) -> str:
    """The last line of a response: in a multi-turn one (decoded without its special tokens) what the model wrote
    after the last tool turn; a response that ends on a tool call ends on its JSON."""
    return response.strip().rsplit("\n", 1)[-1].strip()


def multiply_reward(sample) -> float:
    """1 for the exact product as the final answer, else 0."""
    return float(final_answer(sample.response) == str(sample.label))


@dataclass(frozen=True)
class SyntheticTask:
    make_row: Callable[[random.Random], dict]
    reward: Callable  # a per-sample reward function (see relax.rollout.rewards)


TASKS = {
    "copy_digit": SyntheticTask(_copy_digit_row, copy_digit_reward),
    "reverse3": SyntheticTask(_reverse3_row, reverse3_reward),
    "multiply": SyntheticTask(multiply_row, multiply_reward),
}


def write_task(task: str, num_rows: int, out: str | Path, seed: int = 0) -> Path:
    """Write num_rows prompts of `task` as jsonl rows {"prompt", "label", "metadata": {"task"}}."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose one of {sorted(TASKS)}")
    rng = random.Random(seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for _ in range(num_rows):
            row = TASKS[task].make_row(rng)
            row["metadata"] = {"task": task}
            f.write(json.dumps(row) + "\n")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write a synthetic task's prompts as jsonl.")
    parser.add_argument("--task", required=True, choices=sorted(TASKS))
    parser.add_argument("--num-rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    print(write_task(args.task, args.num_rows, args.out, args.seed))


if __name__ == "__main__":
    main()
