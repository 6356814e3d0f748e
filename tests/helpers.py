"""What test files share: the command line of a `relax train` run that only parses, the check that a command
line is refused at parse time, prompt data written as JSON lines, and a Gated DeltaNet layer's rows split over
context-parallel ranks against the whole rows.

Test files import it as `helpers`: pytest.ini's `pythonpath` puts tests/ on sys.path."""

import json
from pathlib import Path

import pytest
import torch

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


def gdn_rows_split_over_ranks(size: int, lengths: list[int], chunk_rule, device="cpu", heads=2, key_dim=4,
                              value_dim=6, backward=True):
    """A GDN layer's causal convolution (width 4) and gated delta rule (`chunk_rule`, fla's contract) over packed
    sequences of `lengths`, computed once over the whole rows and once as `size` context-parallel ranks compute it
    (relax.train.context_parallel.RecurrenceSplit; the all-gathers done by concatenating in rank order): (name, the
    ranks' value, the whole rows' value) for every rank's convolution and rule outputs and, with `backward`, the
    gradient of every input of a weighted sum of both outputs. float32, random inputs."""

    from relax.train.context_parallel import split_row
    from relax.train.model.gdn_spec import packed_causal_conv1d, positions_in_sequence

    generator = torch.Generator(device=device).manual_seed(1)

    def random(*shape):
        return torch.randn(*shape, generator=generator, device=device)

    cu_seqlens = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    total, width = sum(lengths), 4
    features, weight, bias = random(total, 5), random(5, width), random(5)
    query, key = (torch.nn.functional.normalize(random(1, total, heads, key_dim), dim=-1) for _ in range(2))
    g = -torch.rand(1, total, heads, generator=generator, device=device)
    beta = torch.rand(1, total, heads, generator=generator, device=device)
    inputs = [tensor.requires_grad_(backward) for tensor in (features, query, key, random(1, total, heads, value_dim),
                                                              g, beta)]
    row = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    whole_conv = packed_causal_conv1d(inputs[0], weight, bias, positions_in_sequence(row, total))
    whole_rule, _ = chunk_rule(*inputs[1:4], g=inputs[4], beta=inputs[5], cu_seqlens=row)

    splits = [split_row(cu_seqlens, size, rank, None, device, conv_width=width) for rank in range(size)]
    tails = torch.cat([inputs[0][split.token_index][split.recurrence.tail_index] for split in splits])
    chunk_states = [
        split.recurrence.chunk_states(chunk_rule, *(tensor[:, split.token_index] for tensor in inputs[1:]))
        for split in splits
    ]
    states = torch.cat([final for _, final in chunk_states])
    compared, conv_parts, rule_parts = [], [], []
    for rank, (split, (outputs, _)) in enumerate(zip(splits, chunk_states)):
        rows, positions = split.recurrence.with_preceding_tokens(inputs[0][split.token_index], tails)
        conv_parts.append(packed_causal_conv1d(rows, weight, bias, positions)[split.recurrence.local_rows])
        rule_parts.append(split.recurrence.with_incoming_states(outputs, states))
        compared.append((f"rank {rank}'s convolution", conv_parts[-1], whole_conv[split.token_index]))
        compared.append((f"rank {rank}'s rule", rule_parts[-1], whole_rule[:, split.token_index]))
    if backward:
        conv_weights, rule_weights = random(*whole_conv.shape), random(*whole_rule.shape)
        index = torch.cat([split.token_index for split in splits])
        split_loss = (torch.cat(conv_parts) * conv_weights[index]).sum()
        split_loss = split_loss + (torch.cat(rule_parts, 1).float() * rule_weights[:, index]).sum()
        whole_loss = (whole_conv * conv_weights).sum() + (whole_rule.float() * rule_weights).sum()
        names = ("features", "query", "key", "value", "g", "beta")
        gradients = zip(names, torch.autograd.grad(split_loss, inputs), torch.autograd.grad(whole_loss, inputs))
        compared += [(f"the gradient of {name}", got, expected) for name, got, expected in gradients]
    return compared


def chunk_rule_case(lengths, key_heads, value_heads, K, V, initial, gate_scale, dtype_name, device="cpu", seed=0):
    """Inputs of a chunked gated delta rule (fla's contract) on packed sequences of `lengths`: random q, k, v, beta,
    gates down to -gate_scale, initial states (or None) and cu_seqlens."""
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    dtype = getattr(torch, dtype_name)
    case = dict(
        q=torch.randn(1, tokens, key_heads, K, generator=generator).to(dtype),
        k=torch.randn(1, tokens, key_heads, K, generator=generator).to(dtype),
        v=torch.randn(1, tokens, value_heads, V, generator=generator).to(dtype),
        g=-torch.rand(1, tokens, value_heads, generator=generator) * gate_scale,
        beta=torch.rand(1, tokens, value_heads, generator=generator).to(dtype),
        initial_state=(torch.randn(len(lengths), value_heads, K, V, generator=generator) * 0.1) if initial else None,
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
    )
    return {name: None if x is None else x.to(device) for name, x in case.items()}


def chunk_rule_outputs_and_gradients(rule, case, output_final_state, **kwargs):
    """(outputs, final states, each input's gradient) of `rule` on `case` under a random mix of every output."""
    inputs = {name: None if x is None else x.clone().requires_grad_(x.is_floating_point())
              for name, x in case.items()}
    out, final = rule(**inputs, output_final_state=output_final_state, use_qk_l2norm_in_kernel=True, **kwargs)
    generator = torch.Generator().manual_seed(1)
    objective = (out.float() * torch.randn(out.shape, generator=generator).to(out.device)).sum()
    if output_final_state:
        objective = objective + (final * torch.randn(final.shape, generator=generator).to(out.device)).sum()
    objective.backward()
    grads = {name: x.grad for name, x in inputs.items() if x is not None and x.requires_grad}
    return out, final, grads
