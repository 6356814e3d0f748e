"""What test files share: the command line of a `relax train` run that only parses, the check that a command
line is refused at parse time, and prompt data written as JSON lines.

Test files import it as `helpers`: pytest.ini's `pythonpath` puts tests/ on sys.path."""

import json
from pathlib import Path

import pytest

from relax.args import parse_train_args

# A tiny model's size as flags, for a run with no --hf-checkpoint to read it from.
TINY_SIZE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
# The flags every run must give, and the CPU as its device (the prompt file is not read at parse time).
REQUIRED = ["--lr", "1e-6", "--prompt-data", "prompts.jsonl", "--reward-fn", "math", "--device", "cpu"]
# A run that parses without a checkpoint or data; a test adds the flags it is about.
DRY_RUN = [*REQUIRED, "--dry-run", *TINY_SIZE]


def parse_error(argv: list[str], capsys) -> str:
    """What `relax train argv` prints when its parse refuses argv (exit status 2, argparse's usage error)."""
    with pytest.raises(SystemExit) as exit_info:
        parse_train_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def write_jsonl(path: Path, rows: list) -> Path:
    """Writes each row as one JSON line, and a str row as it is (a line that is not JSON); returns path."""
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def user_prompt_ids(tokenizer, content: str) -> list[int]:
    """The ids of one user message rendered by the chat template, with the assistant's header after it."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
