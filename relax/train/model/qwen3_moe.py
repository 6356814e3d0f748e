"""Qwen3-MoE: Qwen3 attention; every layer's MLP is a top-k router over SwiGLU experts."""

from relax.train.model import qwen2
from relax.train.model.layouts import Rule

top_level_rules = qwen2.top_level_rules
block_spec = qwen2.block_spec


def layer_rules(hf: dict) -> dict[str, Rule]:
    attention = qwen2.attention_rules(hf, qkv_bias=bool(hf.get("attention_bias", False)), qk_norm=True)
    return {**attention, "mlp.router.weight": Rule("replicated", ("model.layers.{layer}.mlp.gate.weight",))}


def expert_rules(hf: dict) -> dict[str, Rule]:
    """Rules for one expert, Megatron names relative to `mlp.experts.local_experts.{i}.`."""
    return qwen2.dense_mlp_rules("model.layers.{layer}.mlp.experts.{expert}.")
