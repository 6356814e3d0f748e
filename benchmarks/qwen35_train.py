"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention) through relax's Megatron actor on one GPU, with a chosen
chunked GDN kernel inside megatron-core's GatedDeltaNet.

    python benchmarks/qwen35_train.py --size 300m --steps 20

1. Parity (fla's kernel on the GPU): a small random Qwen3.5 in float32 (relax.tools.tiny_model, head dims 64): the actor's
   response-token logprobs (MegatronActor.compute_logprobs) against HF transformers' Qwen3_5ForCausalLM on the same
   GPU; max abs diff.
2. Packed rows: the actor's response-token logprobs with every sample of a mixed-length batch packed into one
   micro-batch (one row, THD: attention and the GDN state restart at each sequence) against one sample per
   micro-batch, the same weights; max abs diff. On the small model in float32 with part 1's kernel (skipped with
   part 1), and on the training model (--size) in bf16 with the training GDN kernel, over sequences of up to
   --seq tokens.
3. Training: a random Qwen3.5 of a few hundred million parameters (3 GDN layers to 1 full-attention layer) in
   bf16, MegatronActor.train_step on a fixed batch of patterned sequences (each an arithmetic progression of
   token ids mod the vocabulary, random start and stride) with advantage +1 on every response token (on-policy,
   so the policy-gradient step raises their log-likelihood): the response tokens' mean negative logprob before
   every step (from compute_logprobs) is the loss that must fall; seconds per train step alongside.
--train-gdn-kernel picks the chunked GDN for training (relax.kernels.gdn_training). fla 0.6.0 refuses its own
backward on Hopper GPUs with Triton >= 3.4 and < 3.7.1 (wrong results, fla issue #640; the lent GPUs have Triton 3.6.0
and Triton 3.7.1 is too large to carry); relax's own kernel ("relax", the CUDA default) and the torch reference
("reference") train there. --baseline-gdn-kernel trains the same batch from the same weights again with another
kernel and prints the seconds-per-step ratio of the two (after the first step, which compiles). The kernels used are
printed.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from single_rank import init_distributed

from relax.kernels.gdn_training import GDN_TRAINING_KERNELS

# relax.kernels.gdn_training's, but MindSpeed's (Ascend NPUs only)
TRAINING_KERNELS = tuple(kernel for kernel in GDN_TRAINING_KERNELS if kernel != "mindspeed")
_GDN = dict(linear_conv_kernel_dim=4, full_attention_interval=4)
SIZES = {
    # parity: 4 layers (3 GDN + 1 full attention), head dims 64
    "small": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, **_GDN,
    ),
    # ~0.3B: 16 layers (12 GDN + 4 full attention), Qwen3.5-style head layout at hidden 1024
    "300m": dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2,
        head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, **_GDN,
    ),
}


def write_checkpoint(work_dir: Path, size: str) -> str:
    from relax.tools.tiny_model import build_tiny_model

    out_dir = work_dir / f"qwen3_5_{size}"
    if (out_dir / "config.json").is_file():
        return str(out_dir)
    shape = SIZES[size]
    layer_types = [
        "full_attention" if (i + 1) % shape["full_attention_interval"] == 0 else "linear_attention"
        for i in range(shape["num_hidden_layers"])
    ]
    return str(build_tiny_model(out_dir, "qwen3_5", **shape, layer_types=layer_types))


def make_actor(hf_dir: str, platform, dtype: torch.dtype, lr: float, micro_batch_size: int, gdn_kernel: str):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from relax.train.actor import ActorSettings, MegatronActor
    from relax.hf_checkpoint import read_hf_checkpoint, transformer_config

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    bf16 = dtype == torch.bfloat16
    hf = read_hf_checkpoint(hf_dir)
    transformer = transformer_config(hf, bf16=bf16, params_dtype=dtype, perform_initialization=False)
    optimizer = OptimizerConfig(optimizer="adam", lr=lr, clip_grad=1.0, bf16=bf16, params_dtype=dtype)
    settings = ActorSettings(micro_batch_size=micro_batch_size, keep_reference=False, gdn_training_kernel=gdn_kernel)
    return MegatronActor(hf_dir, transformer, optimizer, DistributedDataParallelConfig(), settings, platform=platform)


def patterned_batch(vocab_size: int, count: int, seq: int, seed: int):
    """Arithmetic progressions of token ids mod the vocabulary; the second half of each row is the response."""
    from relax.train.batch import RolloutBatch

    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab_size, (count,), generator=generator)
    strides = torch.randint(1, 7, (count,), generator=generator)
    tokens = [(start + stride * torch.arange(seq)) % vocab_size for start, stride in zip(starts, strides)]
    response = seq // 2
    return RolloutBatch(tokens, [response] * count, advantages=[torch.ones(response) for _ in range(count)])


def mixed_length_batch(vocab_size: int, lengths: list[tuple[int, int]], seed: int = 5):
    """Random token ids; `lengths` are (tokens, response tokens) per sample."""
    from relax.train.batch import RolloutBatch

    generator = torch.Generator().manual_seed(seed)
    return RolloutBatch(
        [torch.randint(0, vocab_size, (n,), generator=generator) for n, _ in lengths], [r for _, r in lengths]
    )


def logprob_parity(hf_dir: str, platform, gdn_kernel: str, seq: int = 96) -> dict:
    """Max abs diff of response-token logprobs, actor vs HF transformers, float32, same device."""
    import transformers

    actor = make_actor(hf_dir, platform, torch.float32, lr=1e-4, micro_batch_size=2, gdn_kernel=gdn_kernel)
    batch = mixed_length_batch(actor.hf_checkpoint.text_config["vocab_size"], [(seq, 40), (seq // 2 + 7, 20), (33, 9)])
    ours = actor.compute_logprobs(batch)
    device = platform.current_device()
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    diffs = []
    with torch.no_grad():
        for tokens, length, actual in zip(batch.tokens, batch.response_lengths, ours):
            logits = reference(tokens[None].to(device)).logits[0, -length - 1 : -1].float()
            expected = logits.log_softmax(-1).gather(-1, tokens[-length:, None].to(device)).squeeze(-1).cpu()
            diffs.append((actual - expected).abs().max().item())
    del actor, reference
    return {"max_abs_diff": max(diffs), "per_sample": diffs}


def packed_parity(hf_dir: str, platform, dtype: torch.dtype, seq: int, gdn_kernel: str) -> dict:
    """Max abs diff of response-token logprobs: all samples of a mixed-length batch (the longest `seq` tokens) packed
    into one micro-batch against one sample per micro-batch, with the same weights."""
    from relax.hf_checkpoint import read_hf_checkpoint

    lengths = [(seq, seq // 2), (seq // 2 + 7, seq // 4), (33, 9), (seq // 3, seq // 6)]
    batch = mixed_length_batch(read_hf_checkpoint(hf_dir).text_config["vocab_size"], lengths)
    logprobs = {}
    for samples_per_micro_batch in (1, len(batch)):
        actor = make_actor(
            hf_dir, platform, dtype, lr=1e-4, micro_batch_size=samples_per_micro_batch, gdn_kernel=gdn_kernel
        )
        logprobs[samples_per_micro_batch] = actor.compute_logprobs(batch)
        del actor
    diffs = [(packed - alone).abs().max().item() for packed, alone in zip(logprobs[len(batch)], logprobs[1])]
    return {"max_abs_diff": max(diffs), "per_sample": diffs, "sample_tokens": [n for n, _ in lengths]}


def train(
    hf_dir: str, platform, steps: int, samples: int, seq: int, micro_batch_size: int, lr: float, gdn_kernel: str
) -> dict:
    actor = make_actor(hf_dir, platform, torch.bfloat16, lr=lr, micro_batch_size=micro_batch_size, gdn_kernel=gdn_kernel)
    parameters = sum(p.numel() for p in actor.model.parameters())
    batch = patterned_batch(actor.hf_checkpoint.text_config["vocab_size"], samples, seq, seed=0)
    nll, seconds, grad_norms = [], [], []
    if platform.device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps + 1):
        logprobs = actor.compute_logprobs(batch)
        nll.append(-torch.cat(logprobs).mean().item())
        if len(nll) > steps:
            break
        platform.device_module.synchronize()
        start = time.perf_counter()
        metrics = actor.train_step(batch)
        platform.device_module.synchronize()
        seconds.append(time.perf_counter() - start)
        grad_norms.append(metrics["grad_norm"])
    return {
        "parameters_m": parameters / 1e6,
        "gdn_kernel": gdn_kernel,
        "nll_before_each_step": nll,
        "seconds_per_step": seconds,
        "grad_norms": grad_norms,
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9 if platform.device_type == "cuda" else None,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=sorted(SIZES), default="300m")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--train-gdn-kernel", choices=TRAINING_KERNELS, default="relax",
        help="chunked GDN for training (fla 0.6.0 refuses its backward on Hopper with Triton < 3.7.1: fla#640)",
    )
    parser.add_argument("--baseline-gdn-kernel", choices=TRAINING_KERNELS,
                        help="train again with this kernel and print the time ratio")
    parser.add_argument(
        "--no-parity",
        action="store_true",
        help="skip part 1 and the small model's packed-rows parity (tests/gpu/test_qwen35_actor_gpu.py has part 1)",
    )
    parser.add_argument("--work-dir", default="/tmp/relax_qwen35")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    platform = init_distributed(args.device)
    work_dir = Path(args.work_dir)
    results = {}
    if not args.no_parity:
        results["parity_kernel"] = parity_kernel = "fla" if args.device == "cuda" else "reference"
        small = write_checkpoint(work_dir, "small")
        results["parity_small_fp32"] = logprob_parity(small, platform, parity_kernel)
        print("parity", json.dumps(results["parity_small_fp32"]), flush=True)
        results["packed_parity_small_fp32"] = packed_parity(small, platform, torch.float32, 96, parity_kernel)
        print("packed rows parity, small fp32", json.dumps(results["packed_parity_small_fp32"]), flush=True)
    start = time.perf_counter()
    hf_dir = write_checkpoint(work_dir, args.size)
    print(f"wrote {args.size} checkpoint in {time.perf_counter() - start:.1f} s", flush=True)
    results["packed_parity_bf16"] = packed_parity(hf_dir, platform, torch.bfloat16, args.seq, args.train_gdn_kernel)
    print(f"packed rows parity, {args.size} bf16", json.dumps(results["packed_parity_bf16"]), flush=True)
    results["train"] = train(
        hf_dir, platform, args.steps, args.samples, args.seq, args.micro_batch_size, args.lr, args.train_gdn_kernel
    )
    if args.baseline_gdn_kernel:
        results["baseline_train"] = train(hf_dir, platform, args.steps, args.samples, args.seq,
                                          args.micro_batch_size, args.lr, args.baseline_gdn_kernel)
        after_first = [sum(run["seconds_per_step"][1:]) / max(1, len(run["seconds_per_step"]) - 1)
                       for run in (results["baseline_train"], results["train"])]
        results["seconds_per_step_ratio"] = after_first[0] / after_first[1]
        print(f"seconds per step after the first: {args.baseline_gdn_kernel} {after_first[0]:.3f}, "
              f"{args.train_gdn_kernel} {after_first[1]:.3f}: {results['seconds_per_step_ratio']:.2f}x", flush=True)
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **results}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
