"""Qwen3-Next: Qwen3.5-MoE's hybrid layers (see qwen3_5.py) with packed GDN input projections.

HF in_proj_qkvz holds per key head [q (K) | k (K) | v (r*V) | z (r*V)] and in_proj_ba per key head [b (r) | a (r)],
r = value heads per key head; megatron's in_proj holds [q | k | v | z | b | a] over all heads (layout
Segments(..., groups=key heads)).
"""

from relax.train.model import qwen3_5
from relax.train.model.layouts import Rule, Segments

top_level_rules = qwen3_5.top_level_rules
block_spec = qwen3_5.block_spec
expert_rules = qwen3_5.expert_rules


def in_proj_rule(hf: dict) -> Rule:
    key_dim, value_dim = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    key_heads = hf["linear_num_key_heads"]
    ratio = hf["linear_num_value_heads"] // key_heads
    return Rule(
        Segments(((key_dim, key_dim, ratio * value_dim, ratio * value_dim), (ratio, ratio)), groups=key_heads),
        (qwen3_5.GDN_HF_PREFIX + "in_proj_qkvz.weight", qwen3_5.GDN_HF_PREFIX + "in_proj_ba.weight"),
    )


def layer_rules(hf: dict) -> dict[str, Rule]:
    return {
        **qwen3_5.full_attention_rules(hf),
        **qwen3_5.gdn_rules(hf, in_proj_rule(hf)),
        **qwen3_5.mlp_rules(hf),
    }
