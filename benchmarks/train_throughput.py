"""Training throughput and MFU of relax's Megatron actor against plain megatron-core, on one GPU, in one run.

    python benchmarks/train_throughput.py --seq 2048 --micro-batch-size 4 --micro-batches 4

The model is a random Qwen3-shaped HF checkpoint (~1.7B parameters: 24 layers, hidden 2048, 16 query / 4 KV heads
of 128, SwiGLU 5504, vocabulary 151936, untied), written once. Both sides use the same megatron-core
TransformerConfig (bf16, megatron's local layer spec, no TransformerEngine), megatron's DDP and its Adam
optimizer, and the same tokens per step (micro-batches of full-length rows):
    megatron-core  GPTModel + forward_backward_func with GPT's own labels loss (vocab-parallel cross entropy),
                   the causal mask made inside the attention (attention_mask=None); and again with an explicit
                   [rows, 1, seq, seq] causal mask (megatron_core_explicit_mask), the kind the actor passes
    relax          MegatronActor.train_step on a RolloutBatch of the same shape (half of each row a response):
                   the actor's padding-aware attention mask, fp32 per-token logprobs over the vocabulary, the
                   PPO-clip policy loss
Each side: 3 warm-up steps, then the mean of --steps timed steps (device synchronized). MFU counts the model
FLOPs as Megatron's own formula does (matmuls x 3 for forward + backward, causal attention counted whole)
against 989 TFLOP/s (H100/H200 dense bf16); the ratio relax / megatron-core is the figure to read.
"""

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

QWEN3_1_7B = dict(
    hidden_size=2048, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
    head_dim=128, vocab_size=151936, tie_word_embeddings=False,
)
TINY = dict(  # for a smoke run on the CPU (--device cpu --shape tiny)
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=1000, tie_word_embeddings=False,
)
SHAPES = {"1.7b": QWEN3_1_7B, "tiny": TINY}
PEAK_FLOPS = 989e12


def write_checkpoint(out_dir: Path, shape: dict, device: torch.device) -> Path:
    import transformers

    from relax.tiny_model import build_tokenizer

    if (out_dir / "config.json").is_file():
        return out_dir
    tokenizer = build_tokenizer(out_dir)
    config = transformers.Qwen3Config(
        **shape, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    with device:
        model = transformers.Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the sides run in child processes on the same GPU
    return out_dir


def flops_per_step(shape: dict, seq: int, tokens: int) -> float:
    """Megatron's count: 2 FLOPs per multiply-add, x3 for forward + backward, attention over the whole s x s."""
    h, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    per_token_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * shape["intermediate_size"] + 2 * 2 * seq * q
    return 3 * tokens * (layers * per_token_layer + 2 * h * vocab)


def _configs(hf: dict):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from relax.train.model import transformer_config

    transformer = transformer_config(hf, bf16=True, params_dtype=torch.bfloat16, perform_initialization=False)
    optimizer = OptimizerConfig(optimizer="adam", lr=1e-5, clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16)
    return transformer, optimizer, DistributedDataParallelConfig()


def _timed(step, args, platform) -> dict:
    """Mean seconds per step after warm-up, and the peak of allocated device memory (None on the CPU)."""
    cuda = platform.device_type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step()
    platform.device_module.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    platform.device_module.synchronize()
    return {
        "seconds_per_step": (time.perf_counter() - start) / args.steps,
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
    }


def megatron_baseline(hf: dict, args, platform, explicit_mask: bool = False) -> dict:
    """Plain megatron-core: GPTModel (local spec), DDP, Adam, forward_backward_func, GPT's labels loss.
    explicit_mask: pass a [rows, 1, seq, seq] causal mask, as the actor passes its padding-aware one, instead of
    None (the attention then makes its own causal mask)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    device = platform.current_device()
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    config, optimizer_config, ddp_config = _configs(hf)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True, normalization=config.normalization),
        vocab_size=hf["vocab_size"], max_sequence_length=hf["max_position_embeddings"],
        share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_base=1e6,
    ).to(device)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, model))
    optimizer = get_megatron_optimizer(optimizer_config, [model])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    config.grad_scale_func = optimizer.scale_loss
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (args.micro_batch_size, args.seq)
    batches = [
        torch.randint(0, hf["vocab_size"], shape, device=device, generator=generator) for _ in range(args.micro_batches)
    ]
    position_ids = torch.arange(args.seq, device=device).expand(shape)
    attention_mask = None
    if explicit_mask:  # True = masked, megatron's convention
        causal = torch.ones(args.seq, args.seq, dtype=torch.bool, device=device).triu(1)
        attention_mask = causal.expand(args.micro_batch_size, 1, args.seq, args.seq)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        labels = torch.roll(tokens, -1, dims=1)
        losses = model(tokens, position_ids, attention_mask, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return losses, loss_func

    def step():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=args.micro_batches, seq_length=args.seq, micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        optimizer.step()

    return _timed(step, args, platform)


def relax_actor(hf_dir: str, hf: dict, args, platform) -> dict:
    """relax.train.actor.MegatronActor.train_step on batches of the same shape."""
    from relax.train.actor import ActorSettings, MegatronActor
    from relax.train.batch import RolloutBatch

    transformer, optimizer, ddp = _configs(hf)
    settings = ActorSettings(micro_batch_size=args.micro_batch_size, keep_reference=False)
    actor = MegatronActor(hf_dir, transformer, optimizer, ddp, settings, platform=platform)
    generator = torch.Generator().manual_seed(0)
    count = args.micro_batch_size * args.micro_batches
    tokens = [torch.randint(0, hf["vocab_size"], (args.seq,), generator=generator) for _ in range(count)]
    response = args.seq // 2
    advantages = [torch.full((response,), 1.0 if i % 2 else -1.0) for i in range(count)]
    batch = RolloutBatch(tokens, [response] * count, advantages=advantages)
    metrics = []

    def step():
        metrics.append(actor.train_step(batch))

    return {**_timed(step, args, platform), "grad_norms": [m["grad_norm"] for m in metrics]}


SIDES = ("megatron_core", "megatron_core_explicit_mask", "relax")


def run_side(name: str, args, results) -> None:
    """One side in its own process (a fresh device allocator: a side run after another one in the same process
    ran out of memory on the H200), its result put on `results`."""
    from relax.platform import get_platform
    from relax.train.model import read_hf_config

    platform = get_platform(args.device)
    os.environ.update(platform.worker_env())
    platform.prepare_megatron()
    if platform.device_type != "cpu":
        platform.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group(
        platform.dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    hf_dir = str(Path(args.work_dir) / f"qwen3_{args.shape}")
    hf = read_hf_config(hf_dir)
    if name == "relax":
        results.put(relax_actor(hf_dir, hf, args, platform))
    else:
        results.put(megatron_baseline(hf, args, platform, explicit_mask=name == "megatron_core_explicit_mask"))
    torch.distributed.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--work-dir", default="/tmp/relax_train_throughput")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)

    from relax.platform import get_platform

    shape = SHAPES[args.shape]
    write_checkpoint(Path(args.work_dir) / f"qwen3_{args.shape}", shape, get_platform(args.device).current_device())
    tokens = args.seq * args.micro_batch_size * args.micro_batches
    flops = flops_per_step(shape, args.seq, tokens)
    parameters = (
        shape["vocab_size"] * shape["hidden_size"] * (1 if shape["tie_word_embeddings"] else 2)
        + shape["num_hidden_layers"] * (
            shape["hidden_size"] * (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * shape["head_dim"]
            + shape["num_attention_heads"] * shape["head_dim"] * shape["hidden_size"]
            + 3 * shape["hidden_size"] * shape["intermediate_size"]
        )
    )
    results = {"parameters_b": parameters / 1e9, "tokens_per_step": tokens}
    context = mp.get_context("spawn")
    for name in args.sides:
        queue = context.Queue()
        process = context.Process(target=run_side, args=(name, args, queue))
        process.start()
        result = queue.get()
        process.join()
        result["tokens_per_s"] = tokens / result["seconds_per_step"]
        result["mfu"] = flops / result["seconds_per_step"] / PEAK_FLOPS
        results[name] = result
        print(name, json.dumps(result), flush=True)
    if "relax" in results and "megatron_core" in results:
        ratio = results["relax"]["tokens_per_s"] / results["megatron_core"]["tokens_per_s"]
        results["relax_over_megatron_core"] = ratio
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **results}))


if __name__ == "__main__":
    main()
