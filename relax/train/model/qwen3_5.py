"""Qwen3.5 (dense and MoE): hybrid Gated DeltaNet / gated full-attention layers, HF <-> Megatron names and layouts.

HF layer_types says which layers are GDN ("linear_attention", HF `linear_attn.*`, megatron's GatedDeltaNet) and
which are full attention ("full_attention", HF `self_attn.*`, megatron's SelfAttention with attention_output_gate).
Layer specs: gdn_spec.py (no TransformerEngine). All RMSNorms but the GDN output norm scale by (1 + weight).

GDN parameters (Megatron name under `self_attention.` -> HF under `linear_attn.`):
    in_proj.weight   [q | k | v | z | b | a] <- in_proj_qkv [q | k | v], in_proj_z, in_proj_b, in_proj_a
    conv1d.weight    [q | k | v] channels    <- conv1d.weight
    A_log, dt_bias   per value head          <- A_log, dt_bias
    out_norm.weight                          <- norm.weight
    out_proj.weight                          <- out_proj.weight
Full attention: HF q_proj holds per head [query | output gate], Megatron's linear_qkv per query group
[queries | gates | key | value] (layout kind "gated_qkv").
MoE layers: router <- mlp.gate, experts <- mlp.experts.{j}, shared expert <- mlp.shared_expert with its sigmoid
gate mlp.shared_expert_gate (Megatron's shared_experts.gate_weight). HF normalises the top-k router
probabilities, which is Megatron's top-k-then-softmax router (moe_router_pre_softmax=False).
"""

from relax.hf_checkpoint.architecture import layer_types, qwen3_5_is_moe
from relax.train.model import qwen2
from relax.train.model.gdn_spec import hybrid_block_spec
from relax.train.model.layouts import Rule, Segments

top_level_rules = qwen2.top_level_rules


def block_spec(config, hf: dict):
    return hybrid_block_spec(config, layer_types(hf))


GDN_HF_PREFIX = "model.layers.{layer}.linear_attn."


def in_proj_rule(hf: dict) -> Rule:
    """Qwen3.5's four separate input projections, concatenated as megatron's in_proj [q|k|v|z|b|a]."""
    qk = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
    v = hf["linear_num_value_heads"] * hf["linear_value_head_dim"]
    heads = hf["linear_num_value_heads"]
    return Rule(
        Segments(((qk, qk, v), (v,), (heads,), (heads,))),
        tuple(GDN_HF_PREFIX + f"in_proj_{part}.weight" for part in ("qkv", "z", "b", "a")),
    )


def gdn_rules(hf: dict, in_proj: Rule) -> dict[str, Rule]:
    """Rules of a GDN layer's mixer (Megatron names under `self_attention.`), given its in_proj rule."""
    qk = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
    v = hf["linear_num_value_heads"] * hf["linear_value_head_dim"]
    hf_prefix = GDN_HF_PREFIX
    return {
        "self_attention.in_proj.weight": in_proj,
        "self_attention.conv1d.weight": Rule(Segments(((qk, qk, v),)), (hf_prefix + "conv1d.weight",)),
        "self_attention.A_log": Rule("column", (hf_prefix + "A_log",)),
        "self_attention.dt_bias": Rule("column", (hf_prefix + "dt_bias",)),
        "self_attention.out_norm.weight": Rule("replicated", (hf_prefix + "norm.weight",)),
        "self_attention.out_proj.weight": Rule("row", (hf_prefix + "out_proj.weight",)),
    }


def full_attention_rules(hf: dict) -> dict[str, Rule]:
    rules = qwen2.attention_rules(hf, qkv_bias=False, qk_norm=True)
    q_k_v = rules["self_attention.linear_qkv.weight"].hf_names
    return {**rules, "self_attention.linear_qkv.weight": Rule("gated_qkv", q_k_v)}


def mlp_rules(hf: dict) -> dict[str, Rule]:
    hf_prefix = "model.layers.{layer}.mlp."
    if not qwen3_5_is_moe(hf):
        return {"mlp." + name: rule for name, rule in qwen2.dense_mlp_rules(hf_prefix).items()}
    rules = {"mlp.router.weight": Rule("replicated", (hf_prefix + "gate.weight",))}
    if hf.get("shared_expert_intermediate_size"):
        shared = qwen2.dense_mlp_rules(hf_prefix + "shared_expert.")
        rules.update({"mlp.shared_experts." + name: rule for name, rule in shared.items()})
        rules["mlp.shared_experts.gate_weight"] = Rule("replicated", (hf_prefix + "shared_expert_gate.weight",))
    return rules


def layer_rules(hf: dict) -> dict[str, Rule]:
    """Rules for one decoder layer, Megatron names relative to `decoder.layers.{i}.`: a layer holds either the
    GDN or the full-attention parameters (both sets are listed; each layer's own names pick theirs)."""
    return {**full_attention_rules(hf), **gdn_rules(hf, in_proj_rule(hf)), **mlp_rules(hf)}


def expert_rules(hf: dict) -> dict[str, Rule]:
    """Rules for one routed expert, Megatron names relative to `mlp.experts.local_experts.{i}.`."""
    return qwen2.dense_mlp_rules("model.layers.{layer}.mlp.experts.{expert}.") if qwen3_5_is_moe(hf) else {}
