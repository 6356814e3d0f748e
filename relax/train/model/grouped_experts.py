"""MoE experts as grouped matrix products (--moe-grouped-gemm), for relax's layer specs without TransformerEngine.

megatron-core 0.16.1 has no grouped expert module that runs here: GroupedMLP calls the `grouped_gemm` package
(CUDA only, not installable here) and TEGroupedMLP needs TransformerEngine; its local spec runs SequentialMLP, one
expert after another. GroupedExperts holds all local experts' weights as one tensor per projection and runs each
projection as one grouped product over the tokens the dispatcher sorted by expert (the platform record's
grouped_linear: torch._grouped_mm on CUDA, npu_grouped_matmul on NPU, a loop over experts on the CPU).

Parameters, per local expert the tensor SequentialMLP's expert MLP holds (expert tensor parallelism cuts them the
same way), stacked along a leading expert dimension:
    linear_fc1.weight  [local experts, 2 x ffn / ETP, hidden]  per expert [gate rows; up rows] (without a gated
                       unit: [ffn / ETP, hidden]); transformers 5's fused experts.gate_up_proj has this layout
    linear_fc2.weight  [local experts, hidden, ffn / ETP]      transformers 5's experts.down_proj
As in SequentialMLP nothing communicates here: the token dispatcher gathers tokens over the expert-TP ranks and sums
their partial outputs. Checkpoints: sharded_state_dict writes SequentialMLP's keys, global shapes and empty extra
states, so an actor checkpoint written with either module loads into the other.
"""

import re
from functools import partial

import torch

from relax.platform import get_platform, platform_facts

PROJECTIONS = ("linear_fc1", "linear_fc2")
# The dimension of each [experts, out, in] weight that expert TP cuts, as in SequentialMLP's MLPs: fc1's output rows
# (each rank [its gate rows; its up rows]), fc2's input columns.
TP_AXIS = {"linear_fc1": 1, "linear_fc2": 2}


class ExpertWeights(torch.nn.Module):
    """One projection's weights of all local experts: `weight` [experts, out, in]."""

    def __init__(self, weight: torch.nn.Parameter):
        super().__init__()
        self.weight = weight


class GroupedExperts(torch.nn.Module):
    """Drop-in for megatron-core's SequentialMLP in a MoE layer spec (same forward signature)."""

    def __init__(self, num_local_experts: int, config, pg_collection):
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
        from megatron.core.tensor_parallel.layers import _initialize_affine_weight_gpu
        from megatron.core.tensor_parallel.utils import divide

        super().__init__()
        unsupported = {
            "add_bias_linear": config.add_bias_linear,
            "fp8": config.fp8,
            "fp4": config.fp4,
            "glu_linear_offset": config.glu_linear_offset,
            "activation_func_clamp_value": config.activation_func_clamp_value,
            "moe_latent_size": config.moe_latent_size,
        }
        if any(unsupported.values()):
            settings = sorted(name for name, value in unsupported.items() if value)
            raise ValueError(
                f"relax's grouped experts (--moe-grouped-gemm) do not support {settings}: drop --moe-grouped-gemm "
                "(experts then run one by one) or those settings"
            )
        self.config = config
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        ffn = divide(config.moe_ffn_hidden_size, self.tp_group.size())
        fc1_rows = 2 * ffn if config.gated_linear_unit else ffn
        device = "cpu" if config.use_cpu_initialization else get_platform().current_device()
        shapes = {"linear_fc1": (fc1_rows, config.hidden_size), "linear_fc2": (config.hidden_size, ffn)}
        init_methods = {"linear_fc1": config.init_method, "linear_fc2": config.output_layer_init_method}
        for name in PROJECTIONS:
            weight = torch.nn.Parameter(
                torch.empty(num_local_experts, *shapes[name], dtype=config.params_dtype, device=device)
            )
            if config.perform_initialization:
                _initialize_affine_weight_gpu(weight, init_methods[name], partition_dim=TP_AXIS[name], is_expert=True)
            else:
                set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=TP_AXIS[name], stride=1)
            # Megatron's DDP reduces parameters marked allreduce=False over the expert-data-parallel group.
            weight.allreduce = config.expert_model_parallel_size == 1
            setattr(self, name, ExpertWeights(weight))
        # Drop the SequentialMLP-compatible extra states (sharded_state_dict) when a checkpoint loads.
        self.register_load_state_dict_post_hook(_ignore_extra_states)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # (megatron's config allows it only with top-1 routing)
            hidden, probs = (probs.unsqueeze(-1) * hidden).to(hidden.dtype), torch.ones_like(probs)
        grouped_linear = platform_facts(hidden.device.type).grouped_linear
        intermediate = grouped_linear(hidden, self.linear_fc1.weight, tokens_per_expert)
        if self.config.gated_linear_unit:
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = self.config.activation_func(gate) * up
        else:
            intermediate = self.config.activation_func(intermediate)
        intermediate = (intermediate * probs.unsqueeze(-1)).to(hidden.dtype)
        return grouped_linear(intermediate, self.linear_fc2.weight, tokens_per_expert), None

    def backward_dw(self):
        """Weight gradients are computed in the backward pass itself (no delayed weight-gradient step)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """SequentialMLP's checkpoint entries: per projection `{prefix}experts.<projection>.weight` of global shape
        [*sharded_offsets' axes, experts, out, in] (a gated fc1 as its gate and up halves, each cut over expert TP),
        plus an empty extra state per expert and projection."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

        ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
        first_expert, num_experts = ep_rank * self.num_local_experts, ep_size * self.num_local_experts
        replica_id = (0, 0, self.dp_group.rank())
        entries = {}
        for name in PROJECTIONS:
            gated = name == "linear_fc1" and self.config.gated_linear_unit
            entries[f"{prefix}{name}.weight"] = ShardedTensorFactory(
                f"{prefix}experts.{name}.weight",
                getattr(self, name).weight,
                partial(self._build_shards, sharded_offsets=sharded_offsets, gated=gated, tp_axis=TP_AXIS[name]),
                partial(_merge_shards, gated=gated),
                replica_id,
            )
            for expert in range(first_expert, first_expert + self.num_local_experts):
                entries[f"{prefix}expert{expert}.{name}._extra_state"] = ShardedObject(
                    f"{prefix}experts.{name}._extra_state",
                    None,
                    (*(size for _, _, size in sharded_offsets), num_experts),
                    (*(offset for _, offset, _ in sharded_offsets), expert),
                    replica_id=(0, self.tp_group.rank(), self.dp_group.rank()),
                )
        return entries

    @torch.no_grad()
    def _build_shards(self, key, weight, replica_id, flattened_range, *, sharded_offsets, gated: bool, tp_axis: int):
        """This rank's pieces of the global [*prepended, experts, out, in] tensor: its experts (EP) and its expert-TP
        slice; a gated fc1's halves sit in the two halves of the out axis."""
        from megatron.core.dist_checkpointing import ShardedTensor

        if flattened_range is not None:
            raise ValueError(f"{key}: flattened (distributed-optimizer) shards of grouped experts are not supported")
        prepended = len(sharded_offsets)
        ep = (prepended, self.ep_group.rank(), self.ep_group.size())
        tp_rank, tp_size = self.tp_group.rank(), self.tp_group.size()
        if not gated:
            return ShardedTensor.from_rank_offsets(
                key, weight, *sharded_offsets, ep, (prepended + tp_axis, tp_rank, tp_size),
                replica_id=replica_id, prepend_axis_num=prepended,
            )
        return [
            ShardedTensor.from_rank_offsets(
                key, half.contiguous(), *sharded_offsets, ep, (prepended + 1, index * tp_size + tp_rank, 2 * tp_size),
                replica_id=replica_id, prepend_axis_num=prepended,
            )
            for index, half in enumerate(weight.chunk(2, dim=1))
        ]


@torch.no_grad()
def _merge_shards(loaded, gated: bool) -> torch.Tensor:
    return torch.cat(loaded, dim=1) if gated else loaded


_EXTRA_STATE_KEY = re.compile(r".*\.expert\d+\.linear_fc[12]\._extra_state")


def _ignore_extra_states(module, incompatible_keys) -> None:
    for key in [key for key in incompatible_keys.unexpected_keys if _EXTRA_STATE_KEY.fullmatch(key)]:
        incompatible_keys.unexpected_keys.remove(key)


def with_grouped_experts(spec):
    """A layer spec (a ModuleSpec, or TransformerBlockSubmodules of per-layer specs) whose MoE layers hold
    GroupedExperts instead of megatron-core's SequentialMLP; dense layers are left as they are."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[with_grouped_experts(layer) for layer in spec.layer_specs])
    mlp = spec.submodules.mlp
    if not hasattr(mlp.submodules, "experts"):
        return spec
    moe_mlp = dataclasses.replace(
        mlp, submodules=dataclasses.replace(mlp.submodules, experts=ModuleSpec(module=GroupedExperts))
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=moe_mlp))
