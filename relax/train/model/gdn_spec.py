"""megatron-core 0.16.1 layer specs for hybrid Gated DeltaNet / full-attention models (Qwen3.5), without
TransformerEngine.

megatron-core's own builder for these models (models/gpt/experimental_attention_variant_module_specs.py,
get_transformer_block_with_experimental_attention_variant_spec) asserts transformer_impl ==
"transformer_engine". This module builds the same per-layer structure from the local modules of
get_gpt_layer_local_spec: a GDN layer is a TransformerLayer whose self_attention is megatron's own
GatedDeltaNet (in_proj ColumnParallelLinear, out_proj RowParallelLinear) with a forward of relax's that takes packed
rows, a full-attention layer is the local SelfAttention (with config.attention_output_gate) computing with relax's
core attention (core_attention.py), and the MLP is the local dense MLP or MoE layer.

Norms: Qwen3.5's RMSNorms scale by (1 + weight) (HF Qwen3_5RMSNorm, config.layernorm_zero_centered_gamma=True),
which megatron's torch norm refuses; its GDN output norm scales by weight (Qwen3_5RMSNormGated). `RMSNorm`
below does both, in float32 as HF does.
"""

import dataclasses
import functools

import torch

from relax.hf_checkpoint.architecture import FULL_ATTENTION, LINEAR_ATTENTION
from relax.kernels.gdn_training import gdn_training_kernel
from relax.kernels.launch import TritonLaunch
from relax.platform import platform_facts


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in float32: x / rms(x) * (1 + weight) with zero-centred gamma, else * weight.

    Takes megatron's norm arguments (config, hidden_size, eps). `zero_centered_gamma=None` follows
    config.layernorm_zero_centered_gamma; a spec's params can fix it (the GDN output norm does). `tp_local_heads=True`:
    the norm sees only this tensor-parallel rank's heads (the GDN output norm), so the weight's gradient is summed
    over the TP ranks in backward."""

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-6,
        zero_centered_gamma: bool | None = None,
        tp_local_heads: bool = False,
    ):
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = (
            config.layernorm_zero_centered_gamma if zero_centered_gamma is None else zero_centered_gamma
        )
        initial = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(initial(hidden_size, dtype=config.params_dtype))
        if tp_local_heads:
            # finalize_model_grads sums a replicated weight's gradient over TP only under sequence parallelism (and
            # q/k_layernorm by name): without it each rank kept its own heads' part and the replicas drifted apart.
            # Summed here in backward instead, in both cases, so finalize_model_grads must not sum it again.
            setattr(self.weight, "sequence_parallel", False)
            self.weight.register_hook(_sum_over_tensor_parallel_ranks)
        else:
            setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = 1.0 + self.weight.float() if self.zero_centered_gamma else self.weight.float()
        return (normed * scale).to(x.dtype)


def _sum_over_tensor_parallel_ranks(grad: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return grad
    grad = grad.clone()
    torch.distributed.all_reduce(grad, group=group)
    return grad


def sequence_boundaries(packed_seq_params, rows: int, length: int, device) -> torch.Tensor:
    """cu_seqlens (int32 [n+1]) of the sequences in `rows` x `length` tokens laid out row after row: the packed
    rows' own boundaries, else one sequence per row."""
    if packed_seq_params is None:
        return torch.arange(0, (rows + 1) * length, length, dtype=torch.int32, device=device)
    if packed_seq_params.qkv_format != "thd" or rows != 1:
        raise ValueError(f"packed rows must be one thd row, got {packed_seq_params.qkv_format!r} over {rows} rows")
    return packed_seq_params.cu_seqlens_q


def positions_in_sequence(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each token's index inside its own sequence, for `total` tokens split at cu_seqlens."""
    tokens = torch.arange(total, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:].to(torch.long), tokens, right=True)
    return tokens - cu_seqlens.to(torch.long)[sequence]


def packed_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias, positions: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv over tokens [t, d] of packed sequences: tap j of token i reads token i - j only inside
    i's own sequence (positions: each token's index in its sequence), as if every sequence were convolved alone.
    weight [d, w] (tap w-1 multiplies the current token, as nn.Conv1d with padding w-1 orders them); float32."""
    width = weight.shape[-1]
    x32, weight32 = x.float(), weight.float()
    out = x32 * weight32[:, width - 1]
    for shift in range(1, width):
        earlier = torch.nn.functional.pad(x32, (0, 0, shift, 0))[: x.shape[0]]
        out = out + earlier * weight32[:, width - 1 - shift] * (positions >= shift).unsqueeze(-1)
    if bias is not None:
        out = out + bias.float()
    return out


@functools.cache
def _triton_launch(device: torch.device) -> TritonLaunch:
    return platform_facts(device.type).triton_launch(device.index or 0)


@functools.cache
def _packed_gated_delta_net():
    from megatron.core.ssm import gated_delta_net
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class PackedGatedDeltaNet(GatedDeltaNet):
        """megatron's GatedDeltaNet (its parameters, projections and output norm) with a forward that takes packed
        rows: the causal conv and the recurrent state restart at every sequence boundary (megatron-core 0.16.1's
        own forward refuses PackedSeqParams and ignores masks). Without packed rows each row is one sequence. Under
        context parallelism the row's split carries how this rank's chunks get the tokens and the state before them
        (relax.train.context_parallel.RecurrenceSplit). The chunked rule and l2norm are the named training kernel's
        (relax.kernels.gdn_training)."""

        def __init__(self, *args, training_kernel: str = "reference", **kwargs):
            # megatron's constructor refuses to build without fla, which its own forward calls; this forward calls
            # the kernel named here instead.
            gated_delta_net.HAVE_FLA = True
            super().__init__(*args, **kwargs)
            self.training_kernel = training_kernel
            self.chunk_rule, self.l2norm = gdn_training_kernel(training_kernel)

        def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                    attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                    inference_params=None, **kwargs):
            if inference_context is not None or inference_params is not None:
                raise NotImplementedError("relax's GatedDeltaNet trains only: no inference context")
            if attention_mask is not None:
                raise ValueError("GatedDeltaNet takes packed rows (PackedSeqParams), not an attention mask")
            qkvzba, _ = self.in_proj(hidden_states)  # [s, b, d]; sequence parallelism gathers s here
            length, rows = qkvzba.shape[:2]
            total = length * rows
            # Under context parallelism this rank's chunks of the row, whose state comes from the other CP ranks
            recurrence = getattr(packed_seq_params, "row_split", None) and packed_seq_params.row_split.recurrence
            if recurrence is None:
                cu_seqlens = sequence_boundaries(packed_seq_params, rows, length, qkvzba.device)
            qkvzba = qkvzba.transpose(0, 1).reshape(total, -1)  # rows one after another
            tp = self.tp_size
            qkv, gate, beta, alpha = torch.split(
                qkvzba,
                [(2 * self.qk_dim + self.v_dim) // tp, self.v_dim // tp, self.num_value_heads // tp,
                 self.num_value_heads // tp],
                dim=-1,
            )
            if recurrence is None:
                conv_inputs, positions = qkv, positions_in_sequence(cu_seqlens, total)
            else:
                conv_inputs, positions = recurrence.causal_conv_inputs(qkv)
            conv = packed_causal_conv1d(conv_inputs, self.conv1d.weight.squeeze(1), self.conv1d.bias, positions)
            if recurrence is not None:
                conv = conv[recurrence.local_rows]
            qkv = self.act_fn(conv).to(qkv.dtype)
            query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
            query = query.reshape(1, total, -1, self.key_head_dim)
            key = key.reshape(1, total, -1, self.key_head_dim)
            value = value.reshape(1, total, -1, self.value_head_dim)
            if self.use_qk_l2norm:
                query, key = self.l2norm(query.contiguous()), self.l2norm(key.contiguous())
            group = self.num_value_heads // self.num_key_heads
            if group > 1:
                query, key = query.repeat_interleave(group, dim=2), key.repeat_interleave(group, dim=2)
            g = -self.A_log.exp() * torch.nn.functional.softplus(alpha.float() + self.dt_bias)  # float32
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
            g, beta = g.unsqueeze(0), beta.sigmoid().unsqueeze(0)
            chunk_rule = self.chunk_rule
            if self.training_kernel == "relax":  # relax's Triton kernels take the device's launch record
                chunk_rule = functools.partial(chunk_rule, launch=_triton_launch(query.device))
            if recurrence is None:
                core_out, _ = chunk_rule(
                    query, key, value, g=g, beta=beta,
                    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens,
                )
            else:
                core_out = recurrence.gated_delta_rule(chunk_rule, query, key, value, g, beta)
            normed = self._apply_gated_norm(core_out, gate.reshape(total, -1, self.value_head_dim))
            normed = normed.reshape(rows, length, -1).transpose(0, 1).contiguous()
            return self.out_proj(normed)

    return PackedGatedDeltaNet


def gated_delta_net_spec():
    """megatron's GatedDeltaNet (its packed-rows forward) with local linear layers and a plain-weight output norm."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(
        module=_packed_gated_delta_net(),
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear,
            out_norm=ModuleSpec(module=RMSNorm, params={"zero_centered_gamma": False, "tp_local_heads": True}),
            out_proj=RowParallelLinear,
        ),
    )


def with_gdn_kernel(spec, kernel: str):
    """Block submodules (hybrid_block_spec's) whose GDN layers compute with the training kernel `kernel`."""
    def layer(layer_spec):
        attention = layer_spec.submodules.self_attention
        if attention.module is not _packed_gated_delta_net():
            return layer_spec
        attention = dataclasses.replace(attention, params={**attention.params, "training_kernel": kernel})
        return dataclasses.replace(
            layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attention)
        )

    return dataclasses.replace(spec, layer_specs=[layer(layer_spec) for layer_spec in spec.layer_specs])


def hybrid_block_spec(config, layer_types: list[str], vp_stage: int | None = None, pp_rank: int | None = None):
    """TransformerBlockSubmodules for this pipeline stage: layer i is a GDN layer when layer_types[i] is
    "linear_attention" and a full-attention layer when it is "full_attention" (HF's layer_types)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if len(layer_types) != config.num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {config.num_layers} layers")
    unknown = set(layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
    if unknown:
        raise ValueError(
            f"layer_types {sorted(unknown)} are not supported: use {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}"
        )
    if config.pipeline_model_parallel_layout is not None:
        raise ValueError("pipeline_model_parallel_layout is not supported for hybrid GDN models: use uniform stages")

    attention_layer = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, qk_layernorm=True, normalization="RMSNorm"
    )
    norms = dict(input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm)
    attention = attention_layer.submodules.self_attention
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(attention.submodules, q_layernorm=RMSNorm, k_layernorm=RMSNorm),
    )
    full = dataclasses.replace(
        attention_layer, submodules=dataclasses.replace(attention_layer.submodules, self_attention=attention, **norms)
    )
    linear = dataclasses.replace(
        attention_layer,
        submodules=dataclasses.replace(attention_layer.submodules, self_attention=gated_delta_net_spec(), **norms),
    )
    layer_specs = [linear if kind == LINEAR_ATTENTION else full for kind in layer_types]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=layer_specs[offset : offset + count], layer_norm=RMSNorm)
