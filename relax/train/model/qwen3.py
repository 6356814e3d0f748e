"""Qwen3 (dense): Qwen2's layout with q/k RMSNorm per head and, by default, no attention biases."""

from relax.train.model import qwen2
from relax.train.model.layouts import Rule

top_level_rules = qwen2.top_level_rules
block_spec = qwen2.block_spec
expert_rules = qwen2.expert_rules


def layer_rules(hf: dict) -> dict[str, Rule]:
    attention = qwen2.attention_rules(hf, qkv_bias=bool(hf.get("attention_bias", False)), qk_norm=True)
    mlp = {"mlp." + name: rule for name, rule in qwen2.dense_mlp_rules("model.layers.{layer}.mlp.").items()}
    return {**attention, **mlp}
