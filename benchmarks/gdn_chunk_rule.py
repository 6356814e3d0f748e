"""The chunked gated delta rule of the actor's GDN layers, forward and backward, as one layer runs it in training:
relax's kernel (relax.kernels.gdn_chunk_triton, "relax") against the torch reference ("reference") and, where it
imports, flash-linear-attention's ("fla"), on one packed micro-batch of sequences with lognormal lengths.

    python benchmarks/gdn_chunk_rule.py                       # Qwen3.5-9B's GDN shape at TP=1, 16384 tokens, GPU
    TRITON_INTERPRET=1 python benchmarks/gdn_chunk_rule.py --device cpu --tokens 300 --heads 2 --dim 16 --steps 1

Inputs as relax's GatedDeltaNet hands them over (q/k already l2-normed and repeated to the value heads, bf16 q/k/v
and beta, float32 gates). Printed per kernel: milliseconds per forward + backward (an objective mixing every
output), the peak device memory allocated during one beyond the inputs, and the largest difference of its outputs
and input gradients from the reference's, relative to the largest reference value; then each kernel's time ratio
to the reference.
"""

import argparse
import functools

import torch
from single_rank import time_and_peak

from relax.kernels.gdn_training import gdn_training_kernel
from relax.platform import get_platform


def packed_lengths(tokens: int, mean: float, generator) -> list[int]:
    """Lognormal lengths (sigma 1, as rl_batch_throughput draws responses) filling `tokens` exactly."""
    lengths, left = [], tokens
    while left > 0:
        draw = int(torch.distributions.LogNormal(torch.tensor(mean).log() - 0.5, 1.0).sample().clamp(min=1))
        lengths.append(min(draw, left))
        left -= lengths[-1]
    return lengths


def inputs(args, device):
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    lengths = packed_lengths(args.tokens, args.mean_length, generator)
    shape = (1, args.tokens, args.heads, args.dim)
    q, k = (torch.nn.functional.normalize(torch.randn(shape, generator=generator), dim=-1) for _ in range(2))
    v = torch.randn(shape, generator=generator)
    g = -torch.nn.functional.softplus(torch.randn(shape[:3], generator=generator)) * 0.1
    beta = torch.rand(shape[:3], generator=generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)
    tensors = dict(q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16(), g=g, beta=beta.bfloat16())
    objective = torch.randn(shape, generator=generator).to(device)
    return {name: x.to(device) for name, x in tensors.items()}, cu_seqlens, objective, lengths


def forward_backward(rule, tensors, cu_seqlens, objective):
    leaves = {name: x.detach().requires_grad_() for name, x in tensors.items()}
    out, _ = rule(leaves["q"], leaves["k"], leaves["v"], g=leaves["g"], beta=leaves["beta"], initial_state=None,
                  output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens)
    (out.float() * objective).sum().backward()
    return out.detach(), {name: x.grad for name, x in leaves.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, default=16384, help="packed tokens of the micro-batch")
    parser.add_argument("--mean-length", type=float, default=2048.0, help="mean sequence length")
    parser.add_argument("--heads", type=int, default=32, help="value heads on the rank (Qwen3.5-9B: 32 at TP=1)")
    parser.add_argument("--dim", type=int, default=128, help="key and value head dim")
    parser.add_argument("--kernels", default="reference,relax,fla")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    platform = get_platform(args.device)
    device = platform.current_device() if args.device != "cpu" else torch.device("cpu")
    tensors, cu_seqlens, objective, lengths = inputs(args, device)
    print(f"{len(lengths)} sequences of {min(lengths)}-{max(lengths)} tokens ({args.tokens} in all), "
          f"{args.heads} heads of {args.dim}", flush=True)
    results = {}
    for name in args.kernels.split(","):
        try:
            rule, _ = gdn_training_kernel(name)
        except ImportError as error:
            print(f"{name}: skipped ({error})", flush=True)
            continue
        if name == "relax":
            rule = functools.partial(rule, launch=platform.triton_launch(device.index or 0))
        seconds, peak = time_and_peak(lambda: forward_backward(rule, tensors, cu_seqlens, objective), platform,
                                      args.warmup, args.steps)
        results[name] = seconds, forward_backward(rule, tensors, cu_seqlens, objective)
        peak_text = "" if peak is None else f", peak {peak / 2**30:.2f} GiB beyond the inputs"
        print(f"{name}: {seconds * 1e3:.1f} ms per forward + backward{peak_text}", flush=True)
    if "reference" not in results:
        return
    reference_seconds, (reference_out, reference_grads) = results["reference"]
    for name, (seconds, (out, grads)) in results.items():
        differences = [("out", out, reference_out)] + [(n, grads[n], reference_grads[n]) for n in reference_grads]
        relative = ", ".join(f"{n} {(x.float() - y.float()).abs().max().item() / y.float().abs().max().item():.1e}"
                             for n, x, y in differences)
        print(f"{name}: {reference_seconds / seconds:.2f}x the reference's speed; relative max diff: {relative}")


if __name__ == "__main__":
    main()
