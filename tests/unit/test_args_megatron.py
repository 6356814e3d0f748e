"""Megatron flags land in real megatron-core config objects; the HF config supplies the architecture."""

import dataclasses
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig

from helpers import REQUIRED, TINY_SIZE as SIZE, parse_error
from relax.args import build_parser, parse_train_args
from relax.args.megatron import MegatronValues, field_flags
from relax.tools.tiny_model import build_tiny_model

RUN = [*REQUIRED, "--dry-run"]  # the model's size: SIZE or the --hf-checkpoint's


def test_config_objects_are_megatron_cores_own():
    m = parse_train_args([*RUN, *SIZE]).megatron
    assert type(m.transformer) is TransformerConfig
    assert type(m.optimizer) is OptimizerConfig
    assert type(m.ddp) is DistributedDataParallelConfig
    assert (m.transformer.num_layers, m.transformer.hidden_size, m.transformer.num_attention_heads) == (2, 64, 4)


def test_flags_of_every_kind_reach_the_config_objects():
    argv = [*RUN, *SIZE, "--num-devices-per-node", "4", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]
    argv += ["--tensor-model-parallel-size", "2", "--sequence-parallel"]  # int; bool
    argv += ["--recompute-granularity", "selective"]  # Literal
    argv += ["--recompute-modules", "core_attn", "moe"]  # list[str]
    argv += ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall"]
    argv += ["--moe-aux-loss-coeff", "0.01"]  # float | list[float], one value
    argv += ["--attention-backend", "local"]  # Enum
    argv += [
        "--no-attention-softmax-in-fp32",
        "--disable-bias-linear",
        "--norm-epsilon",
        "1e-6",
        "--normalization",
        "RMSNorm",
    ]
    argv += ["--swiglu", "--group-query-attention", "--num-query-groups", "2", "--qk-layernorm", "--bf16"]
    argv += [
        "--weight-decay",
        "0.1",
        "--clip-grad",
        "0.5",
        "--adam-beta1",
        "0.8",
        "--adam-beta2",
        "0.95",
        "--min-lr",
        "1e-7",
    ]
    argv += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--accumulate-allreduce-grads-in-fp32"]
    m = parse_train_args(argv).megatron
    tc, opt, ddp = m.transformer, m.optimizer, m.ddp
    assert (tc.tensor_model_parallel_size, tc.sequence_parallel) == (2, True)
    assert tc.recompute_granularity == "selective" and tc.recompute_modules == ["core_attn", "moe"]
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_token_dispatcher_type) == (4, 2, "alltoall")
    assert tc.moe_aux_loss_coeff == 0.01
    assert tc.attention_backend is AttnBackend.local
    assert tc.attention_softmax_in_fp32 is False and tc.add_bias_linear is False
    assert (tc.layernorm_epsilon, tc.normalization, tc.qk_layernorm) == (1e-6, "RMSNorm", True)
    assert tc.gated_linear_unit is True and tc.activation_func is F.silu and m.model.swiglu
    assert tc.num_query_groups == 2
    assert tc.bf16 and tc.params_dtype is torch.bfloat16 and tc.pipeline_dtype is torch.bfloat16
    assert opt.bf16 and opt.params_dtype is torch.bfloat16
    assert (opt.lr, opt.min_lr, opt.weight_decay, opt.clip_grad, opt.adam_beta1, opt.adam_beta2) == (
        1e-6,
        1e-7,
        0.1,
        0.5,
        0.8,
        0.95,
    )
    assert opt.use_distributed_optimizer and ddp.use_distributed_optimizer  # one flag, both dataclasses
    assert ddp.overlap_grad_reduce and ddp.grad_reduce_in_fp32


def _plain_fields(config) -> dict:
    """A config object's fields, less the callables __post_init__ makes anew (init methods)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {name: value for name, value in values.items() if not callable(value)}


def test_training_workers_get_plain_values_that_import_no_megatron_and_build_the_same_objects():
    argv = [*RUN, *SIZE, "--attention-backend", "local", "--bf16", "--swiglu", "--tensor-model-parallel-size", "2"]
    megatron = parse_train_args([*argv, "--num-devices-per-node", "2"]).megatron
    assert megatron.values.resolved["attention_backend"] == "local"  # the Enum member's name until built
    unpickle = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print(sorted(sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", unpickle], input=pickle.dumps(megatron.values), capture_output=True, timeout=120
    )
    assert result.returncode == 0, result.stderr.decode()
    assert not [name for name in result.stdout.decode().split("'") if name.split(".")[0] == "megatron"]

    built = pickle.loads(pickle.dumps(megatron.values)).build()
    for name in ("transformer", "optimizer", "ddp"):
        assert _plain_fields(getattr(built, name)) == _plain_fields(getattr(megatron, name)), name
    assert built.transformer.attention_backend is AttnBackend.local and built.transformer.activation_func is F.silu
    assert (built.model, built.scheduler) == (megatron.model, megatron.scheduler)


def test_full_recompute_flags_reach_the_transformer_config():
    argv = [*RUN, *SIZE, "--recompute-granularity", "full", "--recompute-method", "uniform"]  # Literal
    tc = parse_train_args([*argv, "--recompute-num-layers", "1"]).megatron.transformer  # int
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "uniform", 1)


def test_megatron_values_refuse_a_value_that_is_not_plain_data():
    with pytest.raises(TypeError, match="attention_backend=<AttnBackend.local.*only plain Python values"):
        MegatronValues({"num_layers": 2, "attention_backend": AttnBackend.local}, num_steps=1)


def test_megatron_lm_spellings_that_store_a_value():
    argv = [
        *RUN,
        *SIZE,
        "--recompute-activations",
        "--no-rope-fusion",
        "--no-bias-swiglu-fusion",
        "--bias-dropout-fusion",
    ]
    tc = parse_train_args(argv).megatron.transformer
    assert tc.recompute_granularity == "selective"
    assert tc.apply_rope_fusion is False and tc.bias_activation_fusion is False and tc.bias_dropout_fusion is True


def test_list_union_takes_several_values_and_tuple_takes_its_length():
    argv = [*RUN, *SIZE, "--moe-aux-loss-coeff", "0.01", "0.02", "--window-size", "8", "0"]
    tc = parse_train_args(argv).megatron.transformer
    assert tc.moe_aux_loss_coeff == [0.01, 0.02] and tc.window_size == (8, 0)
    # int | list[int]: one value is a period (megatron-core expands it per layer), several are the layers
    assert parse_train_args([*RUN, *SIZE, "--no-rope-freq", "2"]).megatron.transformer.no_rope_freq == [0, 1]
    assert parse_train_args([*RUN, *SIZE, "--no-rope-freq", "1", "0"]).megatron.transformer.no_rope_freq == [1, 0]


def test_flags_not_given_keep_megatron_cores_defaults():
    m = parse_train_args([*RUN, *SIZE]).megatron
    assert m.transformer.add_bias_linear is True and m.transformer.params_dtype is torch.float32
    assert (m.optimizer.weight_decay, m.optimizer.adam_beta2, m.optimizer.use_distributed_optimizer) == (
        0.01,
        0.999,
        False,
    )
    assert m.ddp.overlap_grad_reduce is False


def test_model_and_schedule_settings():
    argv = [
        *RUN,
        *SIZE,
        "--vocab-size",
        "1000",
        "--tensor-model-parallel-size",
        "1",
        "--untie-embeddings-and-output-weights",
    ]
    argv += ["--rotary-base", "1000000", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5", "--num-steps", "50"]
    m = parse_train_args(argv).megatron
    assert m.model.vocab_size == 1000 and not hasattr(m.model, "padded_vocab_size")
    assert m.model.untie_embeddings_and_output_weights and m.model.rotary_base == 1e6
    assert (m.scheduler.lr_decay_style, m.scheduler.lr_warmup_iters, m.scheduler.lr_decay_iters) == ("cosine", 5, 50)


def test_uncliable_fields_are_not_flags_and_say_so():
    forms, _, skipped = field_flags()
    for name in (
        "params_dtype",
        "pipeline_dtype",
        "init_method",
        "activation_func",
        "timers",
        "_cpu_offloading_context",
    ):
        assert name in skipped and name not in forms
    assert "params_dtype" in build_parser().format_help()  # listed in the Megatron group's description
    assert "--params-dtype" not in {o for a in build_parser()._actions for o in a.option_strings}


def test_padding_the_vocabulary_is_refused_saying_why(capsys):
    err = parse_error([*RUN, *SIZE, "--make-vocab-size-divisible-by", "128"], capsys)
    assert "--make-vocab-size-divisible-by is not supported: relax trains the checkpoint's vocabulary unpadded" in err
    assert "HF shapes" in err


def write_hf_config(tmp_path, **overrides):
    config = dict(
        model_type="qwen3",
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
    )
    config.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_architecture_comes_from_the_hf_checkpoint(tmp_path):
    m = parse_train_args([*RUN, "--hf-checkpoint", write_hf_config(tmp_path)]).megatron
    tc = m.transformer
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size, tc.num_attention_heads) == (3, 64, 128, 4)
    assert (tc.num_query_groups, tc.kv_channels, tc.layernorm_epsilon, tc.normalization) == (2, 16, 1e-6, "RMSNorm")
    assert (m.model.vocab_size, m.model.max_position_embeddings, m.model.rotary_base) == (300, 512, 1e6)
    assert m.model.untie_embeddings_and_output_weights is False


def test_the_dry_run_shows_the_architecture_the_family_builds(tmp_path):
    # Qwen3 has q/k RMSNorm and SwiGLU: the actor's family mapping says so, no flag needed.
    tc = parse_train_args([*RUN, "--hf-checkpoint", write_hf_config(tmp_path)]).megatron.transformer
    assert tc.qk_layernorm is True and tc.add_qkv_bias is False and tc.add_bias_linear is False
    assert tc.gated_linear_unit is True and tc.activation_func is F.silu
    qwen2 = parse_train_args([*RUN, "--hf-checkpoint", write_hf_config(tmp_path, model_type="qwen2")])
    assert qwen2.megatron.transformer.qk_layernorm is False and qwen2.megatron.transformer.add_qkv_bias is True


def test_a_flag_the_family_overrides_is_an_error(tmp_path, capsys):
    err = parse_error([*RUN, "--hf-checkpoint", write_hf_config(tmp_path), "--no-qk-layernorm"], capsys)
    assert "--qk-layernorm False disagrees with" in err and "config.json (True)" in err
    # Flags that agree with the family are fine.
    assert parse_train_args([*RUN, "--hf-checkpoint", str(tmp_path), "--qk-layernorm", "--swiglu"])


def test_a_model_the_actor_cannot_build_fails_the_dry_run(tmp_path, capsys):
    err = parse_error([*RUN, "--hf-checkpoint", write_hf_config(tmp_path, model_type="llama")], capsys)
    assert "config.json: model_type 'llama'" in err and "is not supported by relax's Megatron actor" in err
    assert "supported model types" in err


def test_a_config_json_without_a_field_the_family_reads_fails_naming_it(tmp_path, capsys):
    config_path = Path(write_hf_config(tmp_path)) / "config.json"
    config = json.loads(config_path.read_text())
    del config["intermediate_size"]
    config_path.write_text(json.dumps(config))
    err = parse_error([*RUN, "--hf-checkpoint", str(tmp_path)], capsys)
    assert "cannot build this qwen3 model: its family mapping reads 'intermediate_size', which config.json lacks" in err


def test_moe_and_gated_deltanet_sizes_come_from_the_hf_checkpoint(tmp_path):
    hybrid = dict(
        model_type="qwen3_5_moe_text",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=3,
        partial_rotary_factor=0.25,
    )
    m = parse_train_args([*RUN, "--hf-checkpoint", write_hf_config(tmp_path, **hybrid)]).megatron
    tc = m.transformer
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size, tc.moe_shared_expert_intermediate_size) == (
        4,
        2,
        32,
        48,
    )
    assert (tc.linear_num_key_heads, tc.linear_num_value_heads, tc.linear_key_head_dim, tc.linear_value_head_dim) == (
        4,
        8,
        16,
        24,
    )
    assert tc.linear_conv_kernel_dim == 3 and m.model.rotary_percent == 0.25
    # The family's layer stack: every 4th layer full (gated) attention, so these 3 are all Gated DeltaNet.
    assert tc.experimental_attention_variant == "gated_delta_net" and tc.linear_attention_freq == [1, 1, 1]
    assert tc.attention_output_gate and tc.layernorm_zero_centered_gamma and tc.moe_shared_expert_gate


def test_an_int_linear_attention_freq_agrees_with_the_familys_layer_list(tmp_path):
    checkpoint = build_tiny_model(tmp_path, "qwen3_5")  # 4 layers: 3 Gated DeltaNet, then full attention
    argv = [*RUN, "--hf-checkpoint", str(checkpoint)]
    argv += ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4"]
    assert parse_train_args(argv).megatron.transformer.linear_attention_freq == [1, 1, 1, 0]


def test_a_multimodal_checkpoint_is_refused_as_the_actor_would(tmp_path, capsys):
    # The actor reads config.json's top level; a vision-language wrapper's model_type is not a family.
    text = dict(model_type="qwen3", num_hidden_layers=5, hidden_size=32, num_attention_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="qwen3_vl", text_config=text)))
    err = parse_error([*RUN, "--hf-checkpoint", str(tmp_path)], capsys)
    assert "config.json: model_type 'qwen3_vl'" in err and "supported model types" in err


def test_a_setting_flag_must_agree_with_the_checkpoint_too(tmp_path, capsys):
    # The actor builds the model from config.json alone: an overriding flag would be silently ignored.
    err = parse_error([*RUN, "--hf-checkpoint", write_hf_config(tmp_path), "--norm-epsilon", "1e-5"], capsys)
    assert "epsilon 1e-05 disagrees with" in err and "config.json (1e-06)" in err


def test_a_shape_flag_must_agree_with_the_checkpoint(tmp_path, capsys):
    err = parse_error([*RUN, "--hf-checkpoint", write_hf_config(tmp_path), "--hidden-size", "128"], capsys)
    assert "--hidden-size 128 disagrees with" in err and "config.json (64)" in err


def test_missing_model_size_names_the_flags(capsys):
    err = parse_error([*RUN, "--num-layers", "2"], capsys)
    assert "give --hidden-size, --num-attention-heads" in err and "--hf-checkpoint" in err


def test_megatron_rejection_is_reported(capsys):
    argv = [*RUN, *SIZE, "--num-devices-per-node", "8", "--tensor-model-parallel-size", "8"]
    assert (
        "megatron-core TransformerConfig rejects these flags: num_attention_heads (4) must be a multiple"
        in parse_error(argv, capsys)
    )


def test_megatron_typo_suggests_the_flag(capsys):
    err = parse_error([*RUN, *SIZE, "--tensor-model-paralel-size", "2"], capsys)
    assert "did you mean --tensor-model-parallel-size" in err


def test_bf16_and_fp16_exclude_each_other(capsys):
    assert "--bf16 and --fp16 are exclusive" in parse_error([*RUN, *SIZE, "--bf16", "--fp16"], capsys)


def test_num_query_groups_needs_group_query_attention(capsys):
    err = parse_error([*RUN, *SIZE, "--num-query-groups", "2"], capsys)
    assert "--num-query-groups needs --group-query-attention" in err


def test_sequence_parallel_needs_tensor_parallel(capsys):
    """megatron-core's rule (its ModelParallelConfig refuses the pair), said with the flags."""
    err = parse_error([*RUN, *SIZE, "--sequence-parallel", "--tensor-model-parallel-size", "1"], capsys)
    assert "--sequence-parallel needs --tensor-model-parallel-size > 1" in err
    with pytest.raises(ValueError, match="sequence parallelism without tensor parallelism"):
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, sequence_parallel=True)


def test_a_real_run_needs_a_checkpoint_directory(tmp_path, capsys):
    argv = [
        "--lr",
        "1e-6",
        "--prompt-data",
        "p",
        "--reward-fn",
        "math",
        "--device",
        "cpu",
        "--hf-checkpoint",
        str(tmp_path),
    ]
    assert f"--hf-checkpoint {tmp_path}: no config.json there" in parse_error(argv, capsys)
