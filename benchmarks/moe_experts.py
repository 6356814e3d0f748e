"""MoE experts, grouped (--moe-grouped-gemm: relax's GroupedExperts, one grouped product per projection) against
sequential (megatron-core's SequentialMLP, one expert after another), in one run.

    python benchmarks/moe_experts.py                      # Qwen3-30B-A3B-shaped, bf16, on the GPU
    python benchmarks/moe_experts.py --tiny --device cpu  # a smoke run of the script itself

Both sides are the MoE layers of a model relax builds for a Qwen3-MoE config (relax.train.model.build_gpt_model:
router, token dispatcher, experts), the grouped side holding the sequential side's weights. A step is the
forward and backward pass of a few of those layers chained with residual connections over one batch of random
hidden states (attention and the rest of the model are the same on both sides and left out). Printed: max |output
difference| between the sides, seconds per step of each side, and sequential / grouped.
"""

import argparse
import time
from pathlib import Path

import torch
from single_rank import init_distributed

QWEN3_30B_A3B = dict(  # one layer of Qwen3-30B-A3B (its config.json), with a small vocabulary (not timed)
    hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
)
TINY = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, intermediate_size=128,
)


def hf_config(shape: dict, layers: int) -> dict:
    return {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1024,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "norm_topk_prob": True, "num_hidden_layers": layers,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **shape,
    }


def moe_layers(hf: dict, dtype: torch.dtype, device, grouped: bool) -> list:
    from relax.hf_checkpoint import hf_checkpoint_of, transformer_config
    from relax.train.model import build_gpt_model

    checkpoint = hf_checkpoint_of(hf, Path("in-memory"))  # no weights: the layers keep their initialisation

    config = transformer_config(
        checkpoint, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        moe_grouped_gemm=grouped,
    )
    model = build_gpt_model(checkpoint, config).to(device)
    return [layer.mlp for layer in model.decoder.layers]


@torch.no_grad()
def copy_weights(sequential: list, grouped: list) -> None:
    for source, target in zip(sequential, grouped):
        target.router.weight.copy_(source.router.weight)
        for name in ("linear_fc1", "linear_fc2"):
            experts = [getattr(expert, name).weight for expert in source.experts.local_experts]
            getattr(target.experts, name).weight.copy_(torch.stack(experts))


def step(layers: list, hidden: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    hidden = hidden.detach().requires_grad_()
    output = hidden
    for layer in layers:
        output = output + layer(output)[0]
    output.backward(grad)
    return output.detach()


def seconds_per_step(layers: list, hidden, grad, platform, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step(layers, hidden, grad)
    platform.device_module.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step(layers, hidden, grad)
    platform.device_module.synchronize()
    return (time.perf_counter() - start) / steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "npu", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny MoE (8 experts of 32) in float32, for the CPU")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (one sequence)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)

    platform = init_distributed(args.device)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    device = platform.current_device()
    hf = hf_config(TINY if args.tiny else QWEN3_30B_A3B, args.layers)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    sequential = moe_layers(hf, dtype, device, grouped=False)
    grouped = moe_layers(hf, dtype, device, grouped=True)
    copy_weights(sequential, grouped)
    generator = torch.Generator(device).manual_seed(0)
    shape = (args.tokens, 1, hf["hidden_size"])  # [sequence, batch, hidden], megatron's layout
    hidden = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    grad = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    difference = (step(sequential, hidden, grad) - step(grouped, hidden, grad)).abs().max().item()

    times = {name: seconds_per_step(layers, hidden, grad, platform, args.warmup, args.steps)
             for name, layers in (("sequential", sequential), ("grouped", grouped))}
    shape_name = "tiny" if args.tiny else "Qwen3-30B-A3B"
    print(f"{shape_name} MoE layers x {args.layers}, {hf['num_experts']} experts top-{hf['num_experts_per_tok']}, "
          f"moe ffn {hf['moe_intermediate_size']}, {args.tokens} tokens, {dtype}, {platform.name}")
    print(f"max |output difference| grouped vs sequential: {difference:.3g}")
    for name, seconds in times.items():
        print(f"{name:>10}: {seconds * 1e3:9.2f} ms per forward+backward step")
    print(f"sequential / grouped: {times['sequential'] / times['grouped']:.2f}x")


if __name__ == "__main__":
    main()
