"""The per-token logprob and entropy over the vocabulary, forward and backward: relax's fused Triton kernels and its
torch pieces of positions (relax.train.logprobs) against megatron-core's vocab-parallel cross entropy and against a
float32 log_softmax over the whole [tokens, vocab] logits, in one run. Peak device memory and time of each side.

    python benchmarks/logprob_entropy.py                                                # 16384 x 151936, bf16, GPU
    python benchmarks/logprob_entropy.py --sides fused log_softmax --block-vocab 2048 4096 8192 --num-warps 4 8
    TRITON_INTERPRET=1 python benchmarks/logprob_entropy.py --device cpu --tokens 16 --vocab 1000 --warmup 1 \
        --steps 1                                                                       # the script's smoke run

Sides (the objective is a random mix of the logprobs and, where a side has them in it, the entropies; its gradient
with respect to the logits is computed):
- fused: relax.train.logprobs.logprobs_and_entropy with the device's launch record (relax.kernels.logprobs_triton's
  one-pass kernels, what the actor runs on a GPU), the entropy in the loss; one side per --block-vocab tile and
  --num-warps count, named fused[tile/warps w] (on the CPU only under TRITON_INTERPRET=1, Triton's interpreter);
- chunked: relax.train.logprobs.logprobs_and_entropy without a launch record (torch over pieces of positions), the
  entropy in the loss (--entropy-coef set);
- chunked_logprobs: the same function, the entropy detached (computed for the metrics only);
- megatron_cross_entropy: megatron-core's vocab_parallel_cross_entropy, logprobs only;
- log_softmax: torch.log_softmax of the float32 logits, logprobs and entropy.
The logits are a fresh [tokens, vocab] tensor of --dtype at every step, made before the step. Printed per side:
milliseconds per forward + backward, the peak device memory allocated during it beyond what was allocated before
it (the logits were: relax's gradient takes their place, the other sides' is a tensor of its own); then, with
log_softmax among the sides, max |difference| of each other side's logprobs, entropies and gradient (of the same
objective) against it.
"""

import argparse
import dataclasses
from typing import Callable

import torch
from single_rank import init_distributed, time_and_peak

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Side:
    compute: Callable  # (logits, labels, temperature) -> (logprobs, entropy or None)
    entropy_in_loss: bool  # whether the objective has the entropy term (the others' has the logprobs only)


def relax_logprobs(launch=None):
    def compute(logits, labels, temperature):
        from relax.train.logprobs import logprobs_and_entropy

        return logprobs_and_entropy(logits, labels, temperature, launch=launch)

    return compute


def megatron_cross_entropy(logits, labels, temperature):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits if temperature == 1.0 else logits / temperature, labels), None


def log_softmax(logits, labels, temperature):
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_p.gather(-1, labels[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


SIDE_NAMES = ("fused", "chunked", "chunked_logprobs", "megatron_cross_entropy", "log_softmax")
REFERENCE = Side(log_softmax, entropy_in_loss=True)


def make_sides(names: list[str], platform, block_vocab: list[int] | None,
               num_warps: list[int] | None) -> dict[str, Side]:
    """The sides to measure by printed name: "fused" becomes one side per vocabulary tile and warp count,
    fused[tile/warps w] (the device's launch record's own where the list is None; fused[tile] under the
    interpreter, which has no warps)."""
    sides = {}
    for name in names:
        if name == "fused":
            from relax.kernels.launch import triton_launch

            launch = triton_launch(platform.triton_target, platform.triton_compute_units(0))
            for tile in block_vocab or [launch.logprob_block_vocab]:
                for warps in num_warps or [launch.options.get("num_warps")]:
                    options = dict(launch.options) if warps is None else {**launch.options, "num_warps": warps}
                    tiled = dataclasses.replace(launch, logprob_block_vocab=tile, options=options)
                    label = f"fused[{tile}]" if warps is None else f"fused[{tile}/{warps}w]"  # no warps: interpreted
                    sides[label] = Side(relax_logprobs(tiled), entropy_in_loss=True)
        elif name in ("chunked", "chunked_logprobs"):
            sides[name] = Side(relax_logprobs(), entropy_in_loss=name == "chunked")
        elif name == "megatron_cross_entropy":
            sides[name] = Side(megatron_cross_entropy, entropy_in_loss=False)
        else:
            sides[name] = REFERENCE
    return sides


def fresh(base):
    """A copy of the logits to hand to one step (relax's backward writes the gradient into them)."""
    return base.clone().requires_grad_()


def step(side: Side, logits, labels, weights, temperature):
    """One forward and backward of `side`: (logprobs, entropy, gradient)."""
    logprobs, entropy = side.compute(logits, labels, temperature)
    objective = (weights[0] * logprobs).sum()
    if side.entropy_in_loss:
        objective = objective + (weights[1] * entropy).sum()
    (gradient,) = torch.autograd.grad(objective, logits)
    return logprobs.detach(), None if entropy is None else entropy.detach(), gradient


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "npu", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the logits' dtype")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--sides", nargs="+", choices=SIDE_NAMES, default=list(SIDE_NAMES))
    parser.add_argument("--block-vocab", type=int, nargs="+",
                        help="the fused side's vocabulary tiles (powers of two), one side each; default: the device's")
    parser.add_argument("--num-warps", type=int, nargs="+",
                        help="the fused side's warps per program, one side each; default: the device's")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    for flag, values in (("--block-vocab", args.block_vocab), ("--num-warps", args.num_warps)):
        if values and "fused" not in args.sides:
            parser.error(f"{flag} sets the fused side's launch: add fused to --sides")
        if any(value < 1 or value & (value - 1) for value in values or []):
            parser.error(f"{flag} takes powers of two, got {values}")

    platform = init_distributed(args.device)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    sides = make_sides(args.sides, platform, args.block_vocab, args.num_warps)
    device = platform.current_device()
    generator = torch.Generator(device).manual_seed(0)
    base = (4 * torch.randn(args.tokens, args.vocab, generator=generator, device=device)).to(DTYPES[args.dtype])
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=generator, device=device)
    weights = torch.randn(2, args.tokens, generator=generator, device=device)

    print(f"{args.tokens} tokens x vocab {args.vocab}, {args.dtype} logits "
          f"({base.numel() * base.element_size() / 2**30:.2f} GiB), temperature {args.temperature}, {platform.name}")
    for name, side in sides.items():
        # the logits, fresh before each step (relax's backward writes the gradient into them), are not timed
        seconds, peak = time_and_peak(lambda logits: step(side, logits, labels, weights, args.temperature), platform,
                                      args.warmup, args.steps, prepare=lambda: (fresh(base),))
        line = f"{name:>22}: {seconds * 1e3:9.2f} ms per forward+backward"
        print(line + (f", peak {peak / 2**30:7.2f} GiB beyond the logits" if peak is not None else ""))
    if "log_softmax" not in sides:
        return
    # After the measurements, so that no reference tensor is held while a side is measured; one side at a time.
    logprobs_only = weights.clone()
    logprobs_only[1] = 0.0  # the objective of the sides without an entropy term
    for name, side in sides.items():
        if side is REFERENCE:
            continue
        logprobs, entropy, gradient = step(side, fresh(base), labels, weights, args.temperature)
        objective_weights = weights if side.entropy_in_loss else logprobs_only
        expected = step(REFERENCE, fresh(base), labels, objective_weights, args.temperature)
        differences = {
            "logprobs": (logprobs - expected[0]).abs().max().item(),
            "entropy": None if entropy is None else (entropy - expected[1]).abs().max().item(),
            "gradient": (gradient.float() - expected[2].float()).abs().max().item(),
        }
        del logprobs, entropy, gradient, expected
        print(f"{name:>22}: max |diff| vs log_softmax: " + ", ".join(
            f"{key} {'-' if value is None else f'{value:.2e}'}" for key, value in differences.items()
        ))


if __name__ == "__main__":
    main()
