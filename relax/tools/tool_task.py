"""The calculator task's warm start: a tiny tool-chat model (relax.tools.tiny_model) trained by teacher forcing on
demonstration conversations of relax.rollout.synthetic's `multiply` task, before RL (scripts/run-tiny-tool-cpu.sh).

A random tiny model never writes a tool call, and RL cannot reward what is never sampled. A demonstration is the
prompt as relax renders it with `--apply-chat-template --tools calculator` (the calculator's JSON schema in the system
turn), the call `<tool_call>\\n{"name": "calculator", "arguments": {"expression": "37*58"}}\\n</tool_call>`, the tool
turn with the calculator's result, and the result as the answer; only the model's own tokens are trained. A share of
the demonstrations (`direct_share`) answers at once, with no call: the product, which a tiny model cannot compute in
its head. The warm-started model calls the calculator in fewer than half its answers, so RL has something to learn:
to call it every time (docs/benchmarks.md, "Tool use on CPU").

What the default model (hidden 64, 2 layers) learned in a probe (batch 16, Adam lr 3e-3, every demonstration with a
call): the fixed format in about 100 steps; copying the question's operands into the call at about step 300 and the
tool's result into the answer at about step 400, suddenly, once it had found how to copy. With half the
demonstrations answering at once (the defaults) the copying came at about step 600-800 of 1000. Copying needs the
offsets fixed: every question has two 2-digit operands and a 4-digit product
(relax.rollout.synthetic.MULTIPLY_OPERANDS).

    python -m relax.tools.tool_task --out runs/tiny-tool-cpu/model
"""

import argparse
import random
from pathlib import Path

import torch
import transformers

from relax.rollout.synthetic import multiply_row
from relax.rollout.tools import Calculator, tool_schema
from relax.rollout.turns import ChatTurns
from relax.tools.tiny_model import build_tiny_model

# The prompt with the calculator's schema is about 470 tokens, the conversation about 570: past the tiny model's
# default context of 512
MAX_POSITION_EMBEDDINGS = 1024


def tool_call_text(expression: str) -> str:
    """The call as the tool-chat template writes it (and relax.rollout.tool_calls parses it)."""
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


def demonstration(tokenizer, turns: ChatTurns, row: dict, use_tool: bool) -> tuple[list[int], list[int]]:
    """One conversation's token ids and loss mask (1 for the model's own tokens) for a `multiply` row."""
    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    prompt = encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": row["prompt"]}], tools=[tool_schema(Calculator())], tokenize=False,
        add_generation_prompt=True,
    ))
    answer = encode(row["label"] + "<|im_end|>")
    if not use_tool:
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)
    call = encode(tool_call_text(row["prompt"]) + "<|im_end|>")
    appended = turns.after_assistant(call, [Calculator()({"expression": row["prompt"]}).text])
    return (prompt + call + appended + answer,
            [0] * len(prompt) + [1] * len(call) + [0] * len(appended) + [1] * len(answer))


def warm_start(model, tokenizer, steps: int, batch_size: int, lr: float, direct_share: float, seed: int,
               log_every: int = 0) -> list[float]:
    """Train `model` in place on `steps` batches of demonstrations drawn with `seed`; returns each batch's loss (the
    mean over its trained tokens, before its update)."""
    rng = random.Random(seed)
    turns = ChatTurns(tokenizer)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    losses = []
    for step in range(steps):
        batch = [demonstration(tokenizer, turns, multiply_row(rng), rng.random() >= direct_share)
                 for _ in range(batch_size)]
        length = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([ids + [pad] * (length - len(ids)) for ids, _ in batch])
        mask = torch.tensor([mask + [0] * (length - len(mask)) for _, mask in batch], dtype=torch.float32)[:, 1:]
        logits = model(ids).logits[:, :-1]
        token_losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (token_losses * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            right = ((logits.argmax(-1) == ids[:, 1:]) | (mask == 0)).all(-1).float().mean().item()
            print(f"warm start step {step}: loss {loss.item():.3f}, conversations all right {right:.2f}", flush=True)
    return losses


def build_warm_started_model(out: str | Path, steps: int = 1000, batch_size: int = 16, lr: float = 3e-3,
                             direct_share: float = 0.5, seed: int = 0, log_every: int = 0) -> Path:
    """A tiny tool-chat qwen3 model (seeded), warm-started on the calculator task and saved to `out`."""
    directory = build_tiny_model(out, "qwen3", seed=seed, tool_chat=True,
                                 max_position_embeddings=MAX_POSITION_EMBEDDINGS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    warm_start(model, tokenizer, steps, batch_size, lr, direct_share, seed, log_every)
    model.save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny tool-chat model warm-started on the calculator task.")
    parser.add_argument("--out", required=True, help="directory to write (created if missing)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--direct-share", type=float, default=0.5,
                        help="the share of demonstrations that answer with no tool call, in [0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50, help="print the loss every this many steps (0: never)")
    args = parser.parse_args(argv)
    if not 0 <= args.direct_share <= 1:
        parser.error(f"--direct-share {args.direct_share}: a share, in [0, 1]")
    torch.set_num_threads(1)  # a model this small gains nothing from more, and the CPU run shares its cores
    transformers.utils.logging.disable_progress_bar()
    print(build_warm_started_model(args.out, args.steps, args.batch_size, args.lr, args.direct_share, args.seed,
                                   args.log_every))


if __name__ == "__main__":
    main()
