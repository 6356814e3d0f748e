"""Training throughput and MFU on a realistic RL batch, on one GPU, in one run: relax's packed rows against the
actor before them (dense masks) and against plain megatron-core (padded rows).

    python benchmarks/rl_batch_throughput.py --out rl_batch.json
    python benchmarks/rl_batch_throughput.py --memory-at 16384 32768
    python benchmarks/rl_batch_throughput.py --sides relax relax_cp --context-parallel-size 2      # two devices
    python benchmarks/rl_batch_throughput.py --sides relax_cp --context-parallel-size 4 --max-response 65536 \
        --max-tokens 66048                                                  # the 64k long tail, four devices

The model is train_throughput.py's random Qwen3-shaped checkpoint (~1.7B parameters). The batch: --num-sequences
samples (256), each a --prompt-len token prompt (512) and a response whose length is drawn, seeded, from a
lognormal distribution (median --median-response 1024, log standard deviation --response-sigma 1.0) clipped to
[1, --max-response 8192]; random token ids. Every side trains on this batch in one optimizer step (global batch =
every sample, cut into micro-batches by a token budget, --max-tokens 16384), with the same TransformerConfig (bf16,
megatron's local layer spec, no TransformerEngine), DDP and Adam, each side in its own process:
    relax          MegatronActor.train_step with the dynamic batch size (max_tokens_per_micro_batch = the budget):
                   samples packed longest first into one row (THD) per micro-batch, attention by the platform's
                   kernel (torch's varlen flash on CUDA), fp32 logprobs, the PPO-clip loss
    relax_cp       the same actor with context parallelism over --context-parallel-size devices (one rank each):
                   every packed row of up to the budget split over them head-tail, keys and values gathered
                   (relax.train.context_parallel); not among the default sides
    relax_before   the actor as it was before packed rows, rebuilt here: megatron-core's local-spec GPTModel
                   (unfused DotProductAttention); consecutive samples in one row per micro-batch while it stays
                   within the budget; a dense block-diagonal causal mask [1, 1, s, s] (True = masked) built on
                   the host every step and copied with its micro-batch; positions restarting per sequence. Its
                   loss is GPT's labels loss over the response tokens, fused into the forward: if anything faster
                   than the actor's fp32 logprobs over the vocabulary were
    megatron_core  megatron-core's local-spec GPTModel with one sample per row, right-padded to the micro-batch's
                   longest; consecutive samples while rows x longest stays within the budget; attention_mask=None
                   (the attention's own causal mask); GPT's labels loss over the response tokens
A side that runs out of device memory is reported and run again, in a fresh process, with half the budget, until
it fits; the budget it ran at is reported. A sample must fit in one row, so below the longest sample's length a
side leaves out the samples longer than its budget (as the actor before packed rows refused them) and trains the
rest: the samples left out are reported, and its figures count only the samples it trained (the long ones, which
cost the most attention, are the ones left out: its throughput is then, if anything, flattered).

Per side: --warmup steps, then the mean of --steps timed steps (device synchronized): seconds per step, real
tokens per second (prompt + response tokens trained, no padding), MFU on real tokens and peak device memory. MFU
counts the FLOPs (train_throughput.flops_per_step) of each sequence at its own length against 989 TFLOP/s, in both
attention conventions: mfu_attention_full (Megatron's formula, the sum over sequences of length^2 whole) and
mfu_attention_causal (half of it, as Megatron-LM's and torchtitan's published figures count); padding and attention
across sequence boundaries count nothing. The ratios relax / relax_before and relax / megatron_core of real tokens per
second are printed last. relax_cp's MFU is per device (its FLOPs over its devices' peak), and relax_cp / relax is
printed both for the step (real tokens per second) and per device (the scaling efficiency of context parallelism).

--memory-at TOKENS [TOKENS ...]: relax's train step only (relax_cp's instead, or as well, where --sides names it), for
each TOKENS on one micro-batch of exactly that many tokens (samples from the same distribution, the last one cut to
fit) with max_tokens_per_micro_batch = TOKENS: its peak device memory (relax_cp: per rank, its share of the row),
beside what `relax train --dry-run` estimates for it (relax.train.memory_estimate, relax_estimate_gb).

--recompute-granularity full|selective: relax's sides with megatron-core's activation recompute (full: every layer
from its input, uniform, one layer at a time), as `relax train --recompute-granularity` sets it.
"""

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path

import torch

from train_throughput import (
    SHAPES,
    flops_per_step,
    mfu,
    megatron_configs,
    parameter_count,
    plain_gpt,
    run_in_own_process,
    timed_steps,
    write_checkpoint,
)

SIDES = ("relax", "relax_cp", "relax_before", "megatron_core")
DEFAULT_SIDES = ("relax", "relax_before", "megatron_core")
RELAX_SIDES = ("relax", "relax_cp")  # the sides --memory-at measures
# config.json's max_position_embeddings: any sequence the flags allow (megatron's RoPE itself takes any length)
MAX_POSITIONS = 131072


def draw_response_lengths(count: int, args, generator: torch.Generator) -> list[int]:
    """Lognormal response lengths: median --median-response, log standard deviation --response-sigma, clipped."""
    drawn = args.median_response * torch.exp(args.response_sigma * torch.randn(count, generator=generator))
    return drawn.round().clamp(1, args.max_response).long().tolist()


def rollout_batch(prompt_lengths: list[int], response_lengths: list[int], vocab_size: int, seed: int):
    """Samples of random token ids, advantages alternating +1 / -1 per sample."""
    from relax.train.batch import RolloutBatch

    generator = torch.Generator().manual_seed(seed)
    tokens = [
        torch.randint(0, vocab_size, (prompt + response,), generator=generator)
        for prompt, response in zip(prompt_lengths, response_lengths)
    ]
    advantages = [torch.full((n,), 1.0 if i % 2 else -1.0) for i, n in enumerate(response_lengths)]
    return RolloutBatch(tokens, response_lengths, advantages=advantages)


def rl_response_lengths(args) -> list[int]:
    """The response lengths of the benchmark's batch."""
    return draw_response_lengths(args.num_sequences, args, torch.Generator().manual_seed(args.seed))


def rl_batch(args, vocab_size: int):
    """The benchmark's batch: --num-sequences samples of --prompt-len prompt tokens and a drawn response."""
    responses = rl_response_lengths(args)
    return rollout_batch([args.prompt_len] * len(responses), responses, vocab_size, args.seed)


def filled_batch(args, vocab_size: int, num_tokens: int):
    """Samples from the same distribution until exactly `num_tokens` tokens: the last one cut to what is left."""
    generator = torch.Generator().manual_seed(args.seed)
    prompts, responses, left = [], [], num_tokens
    while left > 1:
        response = draw_response_lengths(1, args, generator)[0]
        prompt = min(args.prompt_len, left - 1)
        prompts.append(prompt)
        responses.append(min(response, left - prompt))
        left -= prompts[-1] + responses[-1]
    if left:  # one token short of a sample: the previous response takes it
        responses[-1] += left
    return rollout_batch(prompts, responses, vocab_size, args.seed)


def consecutive_micro_batches(token_counts: list[int], max_tokens: int, rows_shape) -> list[list[int]]:
    """Consecutive samples per micro-batch while the tokens of its rows, rows_shape(their lengths) = (rows, row
    length), stay within `max_tokens`."""
    plan = [[]]
    for i, count in enumerate(token_counts):
        if plan[-1] and math.prod(rows_shape([token_counts[j] for j in plan[-1]] + [count])) > max_tokens:
            plan.append([])
        plan[-1].append(i)
    return plan


def one_packed_row(lengths: list[int]) -> tuple[int, int]:
    return 1, sum(lengths)


def one_padded_row_each(lengths: list[int]) -> tuple[int, int]:
    return len(lengths), max(lengths)


def response_positions(length: int, response_length: int) -> slice:
    """The positions of a sequence whose logits predict its response tokens (the logit at p predicts token p + 1)."""
    return slice(length - response_length - 1, length - 1)


def masked_packed_row(batch, members: list[int]):
    """The pre-packing actor's micro-batch: the samples one after another in one row, a dense block-diagonal causal
    mask [1, 1, s, s] (True = masked), positions restarting per sequence. (tokens, positions, mask, loss mask)."""
    lengths = [batch.tokens[i].numel() for i in members]
    total = sum(lengths)
    masked = torch.ones(total, total, dtype=torch.bool)
    loss_mask = torch.zeros(total)
    offset = 0
    for i, n in zip(members, lengths):
        masked[offset : offset + n, offset : offset + n] = torch.ones(n, n, dtype=torch.bool).triu(1)
        span = response_positions(n, batch.response_lengths[i])
        loss_mask[offset + span.start : offset + span.stop] = 1
        offset += n
    tokens = torch.cat([batch.tokens[i] for i in members])
    positions = torch.cat([torch.arange(n) for n in lengths])
    return tokens[None], positions[None], masked[None, None], loss_mask[None]


def right_padded_rows(batch, members: list[int]):
    """One sample per row, right-padded to the longest, no mask. (tokens, positions, None, loss mask)."""
    longest = max(batch.tokens[i].numel() for i in members)
    tokens = torch.zeros(len(members), longest, dtype=torch.long)
    loss_mask = torch.zeros(len(members), longest)
    for row, i in enumerate(members):
        n = batch.tokens[i].numel()
        tokens[row, :n] = batch.tokens[i]
        loss_mask[row, response_positions(n, batch.response_lengths[i])] = 1
    return tokens, torch.arange(longest).expand(len(members), longest), None, loss_mask


def side_devices(name: str, args) -> int:
    return args.context_parallel_size if name == "relax_cp" else 1


def relax_side(platform, hf_dir: str, hf, batch, max_tokens: int, args, context_parallel_size: int) -> dict:
    from relax.train.actor import ActorSettings, MegatronActor
    from relax.train.batch import plan_micro_batches

    transformer, optimizer, ddp = megatron_configs(hf, context_parallel_size)
    transformer = with_recompute(transformer, args.recompute_granularity)
    settings = ActorSettings(max_tokens_per_micro_batch=max_tokens, keep_reference=False,
                             fused_output_logprobs=args.fused_output_logprobs)
    actor = MegatronActor(hf_dir, transformer, optimizer, ddp, settings, platform=platform)
    grad_norms = []
    result = timed_steps(lambda: grad_norms.append(actor.train_step(batch)["grad_norm"]), args, platform)
    micro_batches = plan_micro_batches(batch.token_counts(), 1, max_tokens)
    return {
        **result,
        "micro_batches": len(micro_batches),
        "row_tokens": sum(batch.token_counts()),  # each row exactly its samples: no padding
        "grad_norms": grad_norms,
    }


def with_recompute(transformer, granularity: str | None):
    """The config with megatron-core's activation recompute: "full" recomputes every layer from its input (uniform,
    one layer at a time), "selective" its core attention; None keeps every activation."""
    if granularity is None:
        return transformer
    if granularity == "full":
        return dataclasses.replace(transformer, recompute_granularity="full", recompute_method="uniform",
                                   recompute_num_layers=1)
    return dataclasses.replace(transformer, recompute_granularity="selective")


def relax_estimate_gb(platform, hf, args, num_tokens: int, context_parallel_size: int) -> float:
    """What `relax train --dry-run` estimates for this side's peak allocated memory per device, in GB: the same count
    (relax.args.memory.configs_memory) for this model, layout and micro-batch."""
    from relax.args.memory import configs_memory
    from relax.train.memory_estimate import Layout

    transformer, optimizer, ddp = megatron_configs(hf, context_parallel_size)
    estimate = configs_memory(
        with_recompute(transformer, args.recompute_granularity), optimizer, ddp, hf.text_config["vocab_size"],
        untied=not hf.text_config.get("tie_word_embeddings"), tokens=num_tokens // context_parallel_size,
        layout=Layout(context=context_parallel_size), platform=platform,
        fused_output_logprobs=args.fused_output_logprobs,
    )
    return estimate.total / 1e9


def plain_side(platform, hf_dir: str, hf, batch, max_tokens: int, args, packed_with_mask: bool) -> dict:
    """relax_before (packed_with_mask) or megatron_core: GPT's labels loss over the response tokens."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = platform.current_device()
    model, optimizer, _ = plain_gpt(hf, platform, load_weights=True)
    counts = batch.token_counts()
    rows_shape, make_inputs = (
        (one_packed_row, masked_packed_row) if packed_with_mask else (one_padded_row_each, right_padded_rows)
    )
    plan = consecutive_micro_batches(counts, max_tokens, rows_shape)
    shapes = [rows_shape([counts[i] for i in members]) for members in plan]
    # the schedule divides each micro-batch's loss by their number: the step's loss is the mean over response tokens
    loss_scale = len(plan) / sum(batch.response_lengths)
    grad_norms = []

    def forward_step(data_iterator, model):
        tokens, positions, mask, loss_mask = (t if t is None else t.to(device) for t in next(data_iterator))
        token_losses = model(tokens, positions, mask, labels=torch.roll(tokens, -1, dims=1))

        def loss_func(output):
            loss = (output.float() * loss_mask).sum() * loss_scale
            return loss, {"loss": loss.detach()}

        return token_losses, loss_func

    def step():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            # each micro-batch built on the host during the step, as the actor did
            data_iterator=(make_inputs(batch, members) for members in plan),
            model=[model],
            num_microbatches=len(plan),
            seq_length=max(length for _, length in shapes),
            micro_batch_size=max(rows for rows, _ in shapes),
            forward_only=False,
        )
        grad_norms.append(optimizer.step()[1])

    result = timed_steps(step, args, platform)
    return {
        **result,
        "micro_batches": len(plan),
        "row_tokens": sum(rows * length for rows, length in shapes),
        "grad_norms": grad_norms,
    }


def run_side(platform, name: str, args, max_tokens: int) -> dict:
    """One side at one budget; {"out_of_memory": message} when the device ran out of memory."""
    from relax.hf_checkpoint import read_hf_checkpoint

    hf_dir = checkpoint_dir(args)
    hf = read_hf_checkpoint(hf_dir)
    vocab_size = hf.text_config["vocab_size"]
    batch = filled_batch(args, vocab_size, max_tokens) if args.memory_at else rl_batch(args, vocab_size)
    batch = batch.select(i for i, count in enumerate(batch.token_counts()) if count <= max_tokens)  # see module doc
    try:
        if name in RELAX_SIDES:
            devices = side_devices(name, args)
            result = relax_side(platform, hf_dir, hf, batch, max_tokens, args, devices)
            if args.memory_at:
                result["relax_estimate_gb"] = relax_estimate_gb(platform, hf, args, max_tokens, devices)
            return result
        return plain_side(platform, hf_dir, hf, batch, max_tokens, args, packed_with_mask=name == "relax_before")
    except torch.OutOfMemoryError as error:
        return {"out_of_memory": str(error).splitlines()[0]}


def run_halving_on_oom(name: str, args, lengths: list[int]) -> dict:
    """The side at --max-tokens, then at half the budget after each out-of-memory (see module doc)."""
    budget, out_of_memory_at = args.max_tokens, []
    while budget >= min(lengths):
        result = run_in_own_process(name, args.device, run_side, name, args, budget, ranks=side_devices(name, args))
        if "out_of_memory" not in result:
            return {"max_tokens": budget, "out_of_memory_at": out_of_memory_at, **result}
        print(f"{name}: out of device memory at {budget} tokens per micro-batch: {result['out_of_memory']}", flush=True)
        out_of_memory_at.append(budget)
        budget //= 2
    return {"max_tokens": None, "out_of_memory_at": out_of_memory_at}


def checkpoint_dir(args) -> str:
    return str(Path(args.work_dir) / f"qwen3_{args.shape}")


def batch_summary(args) -> dict:
    """The drawn distribution and the batch's size (from the response lengths alone: no model needed)."""
    responses = rl_response_lengths(args)
    return {
        "num_sequences": len(responses),
        "prompt_len": args.prompt_len,
        "response_median": statistics.median(responses),
        "response_mean": statistics.fmean(responses),
        "response_max": max(responses),
        "responses_at_max": sum(r == args.max_response for r in responses),
        "real_tokens": sum(responses) + args.prompt_len * len(responses),
    }


def memory_at(args) -> dict:
    results = {}
    for name in (side for side in args.sides if side in RELAX_SIDES):
        for num_tokens in args.memory_at:
            result = run_in_own_process(f"{name} at {num_tokens}", args.device, run_side, name, args, num_tokens,
                                        ranks=side_devices(name, args))
            results[str(num_tokens) if name == "relax" else f"{name} {num_tokens}"] = result
            print(f"{name}, one micro-batch of {num_tokens} tokens:", json.dumps(result), flush=True)
    return results


def throughput(args) -> dict:
    summary = batch_summary(args)
    print("batch", json.dumps(summary), flush=True)
    shape = SHAPES[args.shape]
    lengths = [args.prompt_len + r for r in rl_response_lengths(args)]
    results = {"batch": summary, "model_tflop_per_batch": sum(flops_per_step(shape, n, n) for n in lengths) / 1e12}
    for name in args.sides:
        result = run_halving_on_oom(name, args, lengths)
        if result["max_tokens"] is not None:
            trained = [n for n in lengths if n <= result["max_tokens"]]
            result["samples_left_out"] = len(lengths) - len(trained)
            devices = side_devices(name, args)
            result["devices"] = devices
            result["real_tokens_per_s"] = sum(trained) / result["seconds_per_step"]
            result["real_tokens_per_s_per_device"] = result["real_tokens_per_s"] / devices
            result.update(mfu(lambda attention: sum(flops_per_step(shape, n, n, attention) for n in trained) / devices,
                              result["seconds_per_step"]))
        results[name] = result
        print(name, json.dumps(result), flush=True)
    if "real_tokens_per_s" in results.get("relax", {}) and "real_tokens_per_s" in results.get("relax_cp", {}):
        step_ratio = results["relax_cp"]["real_tokens_per_s"] / results["relax"]["real_tokens_per_s"]
        results["relax_cp_over_relax"] = step_ratio
        results["relax_cp_over_relax_per_device"] = step_ratio / args.context_parallel_size
        print(f"relax_cp ({args.context_parallel_size} devices) / relax (one) real tokens per second: "
              f"{step_ratio:.3f}, per device {step_ratio / args.context_parallel_size:.3f}")
    for baseline in ("relax_before", "megatron_core"):
        if "real_tokens_per_s" in results.get("relax", {}) and "real_tokens_per_s" in results.get(baseline, {}):
            ratio = results["relax"]["real_tokens_per_s"] / results[baseline]["real_tokens_per_s"]
            results[f"relax_over_{baseline}"] = ratio
            left_out = {side: results[side]["samples_left_out"] for side in ("relax", baseline)}
            note = f" (samples left out: {left_out})" if any(left_out.values()) else ""
            print(f"relax / {baseline} real tokens per second: {ratio:.3f}{note}")
    return results


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    parser.add_argument("--num-sequences", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--median-response", type=int, default=1024)
    parser.add_argument("--response-sigma", type=float, default=1.0, help="log standard deviation of response lengths")
    parser.add_argument("--max-response", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0, help="of the response lengths and token ids")
    parser.add_argument("--max-tokens", type=int, default=16384, help="token budget of a micro-batch")
    parser.add_argument("--memory-at", type=int, nargs="+", metavar="TOKENS", help="relax's peak memory only (see doc)")
    parser.add_argument("--fused-output-logprobs", action="store_true", help="relax's side with the flag of that name")
    parser.add_argument("--recompute-granularity", choices=("full", "selective"),
                        help="relax's sides with megatron-core's activation recompute (full: uniform, one layer)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(DEFAULT_SIDES))
    parser.add_argument("--context-parallel-size", type=int, default=2, help="relax_cp's devices (one rank each)")
    parser.add_argument("--work-dir", default="/tmp/relax_rl_batch_throughput")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    for flag in ("num_sequences", "prompt_len", "median_response", "max_response", "max_tokens", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    longest = args.prompt_len + args.max_response
    if longest > MAX_POSITIONS:
        parser.error(
            f"--prompt-len + --max-response is {longest}, more than the checkpoint's {MAX_POSITIONS} positions"
        )
    if args.max_tokens < longest:
        parser.error(
            f"--max-tokens {args.max_tokens} is less than the longest possible sample ({longest} = --prompt-len + "
            "--max-response), which must fit in one micro-batch: raise --max-tokens"
        )
    if "relax_cp" in args.sides and args.context_parallel_size < 2:
        parser.error("relax_cp needs --context-parallel-size of at least 2 (relax is the side on one device)")
    if args.memory_at and not set(args.sides) & set(RELAX_SIDES):
        parser.error("--memory-at measures relax or relax_cp: name one of them in --sides")
    if args.memory_at and min(args.memory_at) < 2:
        parser.error("--memory-at needs at least 2 tokens per micro-batch (a sample has a prompt and a response)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from relax.platform import get_platform

    shape = SHAPES[args.shape]
    device = get_platform(args.device).current_device()
    write_checkpoint(Path(checkpoint_dir(args)), shape, device, max_position_embeddings=MAX_POSITIONS)
    print(json.dumps({"parameters_b": parameter_count(shape) / 1e9}), flush=True)
    results = memory_at(args) if args.memory_at else throughput(args)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **results}))


if __name__ == "__main__":
    main()
