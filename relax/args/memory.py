"""The training memory a configuration needs per device (relax.train.memory_estimate's count, from the parsed
flags and the Megatron config): what --dry-run prints and --device-memory-gib is checked against."""

import dataclasses

from relax.train.logprobs import CHUNK_BYTES
from relax.train.memory_estimate import GIB, Layout, MemoryEstimate, estimate_actor_memory


def micro_batch_tokens(flags, megatron) -> int:
    """The most tokens one device trains in a micro-batch: the packed budget, else --micro-batch-size samples of
    the longest sample the run allows (the model's positions, or prompt + response where --max-prompt-length
    bounds the prompts; a dry run without the model and that bound counts the response alone)."""
    if flags.use_dynamic_batch_size and flags.max_tokens_per_device:
        return flags.max_tokens_per_device
    bounds = [megatron.model.max_position_embeddings]
    if flags.max_prompt_length:
        bounds.append(flags.max_prompt_length + flags.rollout_max_response_len)
    known = [bound for bound in bounds if bound]
    return flags.micro_batch_size * (min(known) if known else flags.rollout_max_response_len)


def memory_report(flags, megatron, platform) -> list[str]:
    """--dry-run's lines on the training memory per device."""
    if megatron.model.vocab_size is None:
        return ["training memory per device: not estimated without the vocabulary size (--hf-checkpoint or "
                "--vocab-size)"]
    return actor_memory(flags, megatron, platform).lines()


def actor_memory(flags, megatron, platform) -> MemoryEstimate:
    tc, world = megatron.transformer, flags.num_nodes * flags.num_devices_per_node
    model_parallel = tc.tensor_model_parallel_size * tc.pipeline_model_parallel_size * tc.context_parallel_size
    layout = Layout(
        tensor=tc.tensor_model_parallel_size,
        pipeline=tc.pipeline_model_parallel_size,
        context=tc.context_parallel_size,
        expert=tc.expert_model_parallel_size,
        data=max(1, world // model_parallel),
        sequence_parallel=tc.sequence_parallel,
        distributed_optimizer=megatron.optimizer.use_distributed_optimizer,
    )
    return configs_memory(
        tc, megatron.optimizer, megatron.ddp, megatron.model.vocab_size,
        untied=megatron.model.untie_embeddings_and_output_weights, tokens=micro_batch_tokens(flags, megatron),
        layout=layout, platform=platform, fused_output_logprobs=flags.fused_output_logprobs,
    )


def configs_memory(tc, optimizer, ddp, vocab_size: int, untied: bool, tokens: int, layout: Layout, platform,
                   fused_output_logprobs: bool) -> MemoryEstimate:
    """The estimate for megatron-core's configs (TransformerConfig `tc`, OptimizerConfig, DistributedDataParallelConfig)
    on `platform`: its logprob kernel, and its context-parallel attention, which decides whether the layout keeps the
    row's gathered keys (Layout.keys_gathered). What the dry run counts and what the benchmarks set beside their
    measured peaks (benchmarks/rl_batch_throughput.py --memory-at)."""
    param_bytes = tc.params_dtype.itemsize
    return estimate_actor_memory(
        tc,
        vocab_size=vocab_size,
        untied=untied,
        tokens=tokens,
        layout=dataclasses.replace(layout, keys_gathered=platform.context_parallel_attention == "all-gather"),
        param_bytes=param_bytes,
        grad_bytes=4 if ddp.grad_reduce_in_fp32 else param_bytes,
        optimizer=optimizer.optimizer,
        logprob_pieces_bytes=CHUNK_BYTES if platform.logprob_kernel == "torch" else 0,
        fused_output_piece_bytes=CHUNK_BYTES if fused_output_logprobs else 0,
    )


def memory_for_training(flags, sglang) -> float | None:
    """Bytes of one device the actor may use: all of it when colocated (the engines release theirs while it
    trains), less the engines' static share when they stay resident beside it (None: that share is SGLang's own
    choice at start-up, unknown before)."""
    if flags.colocate or flags.rollout_num_devices:
        return flags.device_memory_gib * GIB
    if sglang.mem_fraction_static is None:
        return None
    return flags.device_memory_gib * GIB * (1.0 - sglang.mem_fraction_static)
