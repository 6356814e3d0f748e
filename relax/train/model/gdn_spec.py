"""megatron-core 0.16.1 layer specs for hybrid Gated DeltaNet / full-attention models (Qwen3.5), without
TransformerEngine.

megatron-core's own builder for these models (models/gpt/experimental_attention_variant_module_specs.py,
get_transformer_block_with_experimental_attention_variant_spec) asserts transformer_impl ==
"transformer_engine". This module builds the same per-layer structure from the local modules of
get_gpt_layer_local_spec: a GDN layer is a TransformerLayer whose self_attention is megatron's own
GatedDeltaNet (in_proj ColumnParallelLinear, out_proj RowParallelLinear; a subclass only refuses attention masks
that pack several sequences in a row, which GatedDeltaNet would silently ignore), a full-attention layer is the local
SelfAttention (with config.attention_output_gate), and the MLP is the local dense MLP or MoE layer.

Norms: Qwen3.5's RMSNorms scale by (1 + weight) (HF Qwen3_5RMSNorm, config.layernorm_zero_centered_gamma=True),
which megatron's torch norm refuses; its GDN output norm scales by weight (Qwen3_5RMSNormGated). `RMSNorm`
below does both, in float32 as HF does.
"""

import dataclasses
import functools

import torch

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


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


def refuse_packed_rows(attention_mask: torch.Tensor) -> None:
    """Raise unless every row of `attention_mask` ([b, 1, s, s], True = masked) holds one causal sequence and
    padding: each position sees either all positions up to itself or only itself (padding, and a sequence's first
    token). A row packing several sequences (a block-diagonal mask) has positions that see a later start."""
    allowed = ~attention_mask[:, 0]
    seq = allowed.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=allowed.device).tril()
    itself = torch.eye(seq, dtype=torch.bool, device=allowed.device)
    if not ((allowed == causal).all(-1) | (allowed == itself).all(-1)).all():
        raise ValueError(
            "megatron-core 0.16.1's GatedDeltaNet ignores attention_mask, so a row packing several sequences would "
            "carry the recurrent state from one sequence into the next: give hybrid GDN models (qwen3_5, "
            "qwen3_next) one padded sequence per row (no token-budget packing)"
        )


@functools.cache
def _one_sequence_per_row_gated_delta_net():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class OneSequencePerRowGatedDeltaNet(GatedDeltaNet):
        """megatron's GatedDeltaNet, refusing masks it would silently ignore (refuse_packed_rows)."""

        def forward(self, hidden_states, attention_mask, *args, **kwargs):
            if attention_mask is not None:
                refuse_packed_rows(attention_mask)
            return super().forward(hidden_states, attention_mask, *args, **kwargs)

    return OneSequencePerRowGatedDeltaNet


def gated_delta_net_spec():
    """megatron's GatedDeltaNet (checking its mask) with local linear layers and a plain-weight output norm."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(
        module=_one_sequence_per_row_gated_delta_net(),
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear,
            out_norm=ModuleSpec(module=RMSNorm, params={"zero_centered_gamma": False, "tp_local_heads": True}),
            out_proj=RowParallelLinear,
        ),
    )


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
