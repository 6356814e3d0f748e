"""Synthetic tasks for the tiny CPU demo: small enough for a ~80k-parameter random model to learn with
GRPO in a few dozen steps, with a verifiable reward in [0, 1].

Both tasks use only characters of relax.tiny_model's alphabet (one token per character) and answer in
one to three tokens, so a random policy already earns partial reward now and then and GRPO has a
signal from the first step:

- copy_digit: "copy 7:" -> "7"        (learn to attend to one position and stop)
- reverse3:   "reverse abc:" -> "cba" (learn three positional copies in reverse order)

The reward is positional character agreement: the number of positions where response and answer
agree, divided by the longer of the two lengths. An exact answer scores 1; a right first character
followed by junk scores less; every extra character costs, so the model also learns to stop.

Write a task's prompts with:
    python -m relax.rollout.synthetic --task copy_digit --num-rows 2000 --out data/copy_digit.jsonl
"""

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REVERSE_LETTERS = "abcdefgh"  # a small set keeps the task inside a tiny model's reach


def char_match_score(response: str, answer: str) -> float:
    response = response.strip()
    if not response:
        return 0.0
    matches = sum(a == b for a, b in zip(response, answer))
    return matches / max(len(response), len(answer))


def _copy_digit_row(rng: random.Random) -> dict:
    digit = str(rng.randrange(10))
    return {"prompt": f"copy {digit}:", "label": digit}


def _reverse3_row(rng: random.Random) -> dict:
    letters = "".join(rng.choice(REVERSE_LETTERS) for _ in range(3))
    return {"prompt": f"reverse {letters}:", "label": letters[::-1]}


def synthetic_reward(sample) -> float:
    """Positional character agreement of the response with the label, in [0, 1]."""
    return char_match_score(sample.response, str(sample.label))


@dataclass(frozen=True)
class SyntheticTask:
    make_row: Callable[[random.Random], dict]
    reward: Callable  # a per-sample reward function (see relax.rollout.rewards)


TASKS = {
    "copy_digit": SyntheticTask(_copy_digit_row, synthetic_reward),
    "reverse3": SyntheticTask(_reverse3_row, synthetic_reward),
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
