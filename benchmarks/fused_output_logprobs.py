"""The output layer with the per-token logprob and entropy, forward and backward, as the actor runs them: the logits
made by the output projection then relax.train.logprobs.logprobs_and_entropy (the default), against
output_logprobs_and_entropy, the projection fused with them over pieces (--fused-output-logprobs). Peak device
memory and time of each, with and without a backward, and how far the fused values and gradients are from the
logits' side.

    python benchmarks/fused_output_logprobs.py                          # Qwen3.5-9B's output layer, 16384 tokens, GPU
    python benchmarks/fused_output_logprobs.py --device cpu --tokens 64 --hidden 32 --vocab 1000 --warmup 1 --steps 1

Both sides use the platform's logprob kernels (relax.train.logprobs.platform_launch: the Triton ones on CUDA), the
entropy in the objective (a random mix of logprobs and entropies) and the temperature given. Printed per side:
milliseconds per forward + backward and per forward alone (no_grad, as the old-policy and reference passes), the
peak device memory allocated during each beyond the hidden states and weight made before; then the largest
difference of the fused side's logprobs, entropies and gradients from the logits' side, relative to the largest
value of each.
"""

import argparse

import torch
from single_rank import time_and_peak

from relax.platform import get_platform
from relax.train.logprobs import logprobs_and_entropy, output_logprobs_and_entropy, platform_launch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def through_logits(hidden, weight, labels, temperature, launch):
    return logprobs_and_entropy(hidden @ weight.T, labels, temperature, launch=launch)


def fused(hidden, weight, labels, temperature, launch):
    return output_logprobs_and_entropy(hidden, weight, labels, temperature, launch=launch)


SIDES = {"logits": through_logits, "fused": fused}


def step(side, hidden, weight, labels, weights, temperature, launch, backward: bool):
    """One forward (and backward) of `side`: logprobs, entropy and, with a backward, the hidden states' and the
    weight's gradients."""
    if not backward:
        with torch.no_grad():
            return side(hidden, weight, labels, temperature, launch)
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    logprobs, entropy = side(hidden, weight, labels, temperature, launch)
    objective = (weights[0] * logprobs).sum() + (weights[1] * entropy).sum()
    hidden_grad, weight_grad = torch.autograd.grad(objective, (hidden, weight))
    return logprobs.detach(), entropy.detach(), hidden_grad, weight_grad


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "npu", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=248320, help="this rank's rows of the output weight")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the hidden states' and weight's")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)

    platform = get_platform(args.device)
    if platform.device_type != "cpu":
        platform.set_device(0)
    device = platform.current_device()
    launch = platform_launch(platform, device.index or 0)
    generator = torch.Generator(device).manual_seed(0)
    dtype = DTYPES[args.dtype]
    hidden = torch.randn(args.tokens, args.hidden, generator=generator, device=device).to(dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=generator, device=device) / args.hidden**0.5).to(dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=generator, device=device)
    weights = torch.randn(2, args.tokens, generator=generator, device=device)
    inputs = (hidden, weight, labels, weights, args.temperature, launch)

    logits_gib = args.tokens * args.vocab * hidden.element_size() / 2**30
    print(f"{args.tokens} tokens x hidden {args.hidden} x vocab {args.vocab}, {args.dtype} (logits {logits_gib:.2f} "
          f"GiB), temperature {args.temperature}, {platform.name}, logprob kernels: {platform.logprob_kernel}")
    for name, side in SIDES.items():
        for backward in (True, False):
            seconds, peak = time_and_peak(lambda: step(side, *inputs, backward=backward), platform, args.warmup,
                                          args.steps)
            what = "forward+backward" if backward else "forward alone"
            line = f"{name:>7}: {seconds * 1e3:9.2f} ms per {what:<16}"
            print(line + (f", peak {peak / 2**30:6.2f} GiB beyond the inputs" if peak is not None else ""))
    expected = step(through_logits, *inputs, backward=True)
    got = step(fused, *inputs, backward=True)
    differences = [
        f"{name} {((a.float() - b.float()).abs().max() / b.float().abs().max()).item():.2e}"
        for name, a, b in zip(("logprobs", "entropy", "hidden grad", "weight grad"), got, expected)
    ]
    print("fused vs logits, max |difference| / max |value|: " + ", ".join(differences))


if __name__ == "__main__":
    main()
