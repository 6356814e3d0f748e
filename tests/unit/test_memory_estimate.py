"""The training memory estimate (relax.train.memory_estimate) and --device-memory-gib's check."""

import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from helpers import DRY_RUN, parse_error
from relax.args import parse_train_args
from relax.args.memory import actor_memory, memory_for_training
from relax.hf_checkpoint import read_hf_checkpoint, transformer_config
from relax.platform import platform_facts
from relax.tools.tiny_model import FAMILIES, build_tiny_model
from relax.train.memory_estimate import GIB, Layout, estimate_actor_memory, parameter_count

# train_throughput.py's and rl_batch_throughput.py's 1.69B Qwen3 shape (vocabulary 151,936, untied)
QWEN3_1_7B_SHAPE = dict(
    num_layers=24, hidden_size=2048, num_attention_heads=16, num_query_groups=4, kv_channels=128,
    ffn_hidden_size=5504, gated_linear_unit=True, bf16=True, params_dtype=torch.bfloat16,
)
VOCAB = 151936


def _shape(**overrides) -> TransformerConfig:
    return TransformerConfig(**{**QWEN3_1_7B_SHAPE, **overrides})


def _estimate(tc=None, tokens=16384, layout=Layout(), **kwargs):
    options = dict(dict(param_bytes=2, grad_bytes=2, optimizer="adam", logprob_pieces_bytes=0), **kwargs)
    return estimate_actor_memory(tc or _shape(), VOCAB, True, tokens, layout, **options)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_parameter_count_is_the_checkpoints(family, tmp_path):
    checkpoint = read_hf_checkpoint(build_tiny_model(tmp_path, family))
    tc = transformer_config(checkpoint, num_layers=checkpoint.transformer_fields.get("num_layers"))
    counted = sum(parameter_count(tc, checkpoint.model_fields["vocab_size"],
                                  checkpoint.model_fields["untie_embeddings_and_output_weights"]))
    assert counted == sum(math.prod(entry.shape) for entry in checkpoint.tensors.values())


def test_bf16_adam_state_is_sixteen_bytes_a_parameter_and_activations_grow_with_the_tokens():
    small, large = _estimate(tokens=8192), _estimate(tokens=16384)
    assert small.parameter_count == 1_685_686_272
    static = small.parameters + small.gradients + small.optimizer
    assert static == 16 * small.parameter_count  # bf16 weights and grads, fp32 main weights and two moments
    assert (large.activations, large.logits) == (2 * small.activations, 2 * small.logits)
    # the measured peak of this shape at 16,384 tokens with the logprobs over pieces: 72.4 GB (docs/benchmarks.md)
    measured = _estimate(tokens=16384, logprob_pieces_bytes=256 * 2**20)
    assert measured.total / 1e9 == pytest.approx(72.4, rel=0.06)


def test_parallelism_recompute_and_a_sharded_optimizer_each_lower_what_they_split():
    base = _estimate()
    tp2 = _estimate(layout=Layout(tensor=2))
    assert tp2.parameter_count < base.parameter_count / 1.9 and tp2.logits == base.logits // 2
    assert tp2.activations < base.activations
    cp4 = _estimate(layout=Layout(context=4))  # the same tokens per device: each layer keeps the gathered K/V
    assert cp4.activations - base.activations == 24 * (4 - 1) * 2 * 4 * 128 * 16384 * 2
    ring = _estimate(layout=Layout(context=4, keys_gathered=False))  # MindSpeed's ring: each rank its own K/V
    assert ring.activations == base.activations
    sharded = _estimate(layout=Layout(data=4, distributed_optimizer=True))
    assert sharded.optimizer == base.optimizer // 4 and sharded.parameters == base.parameters
    full = _estimate(_shape(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    assert full.activations < base.activations / 5
    selective = _estimate(_shape(recompute_granularity="selective", recompute_modules=["mlp"]))
    assert full.activations < selective.activations < base.activations


def test_fused_output_logprobs_count_a_piece_of_the_logits_and_the_hidden_states_gradient():
    whole, fused = _estimate(), _estimate(fused_output_piece_bytes=256 * 2**20)
    assert whole.logits == 3 * 16384 * VOCAB * 2
    assert fused.logits == 256 * 2**20 + 16384 * 2048 * (4 + 2)
    assert fused.total == whole.total - whole.logits + fused.logits
    assert "fused output layer (a piece of the logits) 0.44 GiB" in fused.lines()[1]
    argv = [*DRY_RUN, "--vocab-size", "151936", "--fused-output-logprobs"]
    config = parse_train_args(argv)
    assert config.actor.fused_output_logprobs
    assert actor_memory(config.flags, config.megatron, platform_facts("cpu")).fused_output


def test_a_gdn_layers_backward_counts_where_it_is_larger_than_the_logits():
    # Qwen3.5-9B's GDN heads (32 value heads, K = V = 128); relax's rule measured 8.97 GiB beyond its inputs for one
    # layer's forward + backward on 16,384 tokens of this shape (benchmarks/gdn_chunk_rule.py on an H100)
    qwen35 = _shape(num_layers=32, hidden_size=4096, kv_channels=256, ffn_hidden_size=12288,
                    experimental_attention_variant="gated_delta_net", linear_attention_freq=4, linear_num_key_heads=16,
                    linear_key_head_dim=128, linear_num_value_heads=32, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4)
    whole, fused = _estimate(qwen35), _estimate(qwen35, fused_output_piece_bytes=256 * 2**20)
    assert whole.gdn_backward / GIB == pytest.approx(8.97, rel=0.01)
    static = whole.parameters + whole.gradients + whole.optimizer + whole.activations
    assert whole.logits > whole.gdn_backward and whole.total == static + whole.logits  # never live together
    assert fused.logits < fused.gdn_backward and fused.total == static + fused.gdn_backward
    assert "one GDN layer's backward 8.96 GiB" in fused.lines()[1]
    assert _estimate(qwen35, layout=Layout(tensor=2)).gdn_backward == whole.gdn_backward // 2
    # under context parallelism the rule runs on values widened by a key head (relax.train.context_parallel)
    assert _estimate(qwen35, layout=Layout(context=2)).gdn_backward > whole.gdn_backward
    assert _estimate().gdn_backward == 0 and "GDN" not in _estimate().lines()[1]  # no GDN layer


def test_experts_split_over_expert_parallelism():
    moe = _shape(num_moe_experts=8, moe_ffn_hidden_size=768, moe_router_topk=2, moe_grouped_gemm=True)
    one, four = _estimate(moe), _estimate(moe, layout=Layout(expert=4))
    experts_per_rank = 24 * 8 * 3 * 2048 * 768
    assert one.parameter_count - four.parameter_count == experts_per_rank * 3 // 4


def test_the_dry_run_prints_the_estimate(capsys):
    from relax.cli import main

    assert main(["train", *DRY_RUN, "--vocab-size", "64"]) == 0
    assert "training memory per device (estimate of the peak allocated" in capsys.readouterr().out
    assert main(["train", *DRY_RUN]) == 0
    assert "training memory per device: not estimated without the vocabulary size" in capsys.readouterr().out


def test_a_layout_that_does_not_fit_the_device_is_refused_naming_the_fixes(capsys):
    argv = [*DRY_RUN, "--use-dynamic-batch-size", "--max-tokens-per-device", "65536", "--vocab-size", "151936"]
    estimate = actor_memory(parse_train_args(argv).flags, parse_train_args(argv).megatron, platform_facts("cpu"))
    fits = f"{estimate.total / GIB * 1.1:.3f}"
    assert parse_train_args([*argv, "--device-memory-gib", fits]).flags.device_memory_gib == float(fits)
    error = parse_error([*argv, "--device-memory-gib", f"{estimate.total / GIB * 0.9:.3f}"], capsys)
    assert "the training actor is estimated to need" in error and "lower --max-tokens-per-device" in error


def test_engines_beside_the_actor_leave_it_the_rest_of_the_device(capsys):
    argv = [*DRY_RUN, "--vocab-size", "64"]
    estimate = actor_memory(parse_train_args(argv).flags, parse_train_args(argv).megatron, platform_facts("cpu"))
    device = ["--device-memory-gib", f"{estimate.total / GIB / 0.9:.4f}"]
    assert parse_train_args([*argv, *device]).flags.colocate  # colocated: the whole device while it trains
    beside = [*argv, *device, "--no-colocate", "--rollout-num-devices", "0", "--sglang-mem-fraction-static", "0.5"]
    assert "the training actor is estimated to need" in parse_error(beside, capsys)


def test_an_engine_share_chosen_at_start_up_cannot_be_checked_before():
    beside = SimpleNamespace(colocate=False, rollout_num_devices=0, device_memory_gib=80.0)
    assert memory_for_training(beside, SimpleNamespace(mem_fraction_static=None)) is None
    assert memory_for_training(beside, SimpleNamespace(mem_fraction_static=0.25)) == 60 * GIB


def test_the_npu_estimate_under_context_parallelism_keeps_each_ranks_own_keys_and_values():
    """The NPU's context-parallel attention is MindSpeed's ring (no rank keeps the whole row's keys and values), the
    CPU's relax's all-gather: the same layout, fewer activations."""
    argv = [*DRY_RUN, "--vocab-size", "64", "--num-devices-per-node", "2", "--context-parallel-size", "2"]
    config = parse_train_args(argv)
    gathered = actor_memory(config.flags, config.megatron, platform_facts("cpu"))
    ring = actor_memory(config.flags, config.megatron, platform_facts("npu"))
    assert ring.activations < gathered.activations
    assert (ring.parameters, ring.optimizer, ring.logits) == (gathered.parameters, gathered.optimizer, gathered.logits)
