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

from relax.train.model import qwen2
from relax.train.model.gdn_spec import FULL_ATTENTION, LINEAR_ATTENTION, hybrid_block_spec
from relax.train.model.layouts import Rule, Segments

MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
top_level_rules = qwen2.top_level_rules


def layer_types(hf: dict) -> list[str]:
    """Per-layer kind: HF's layer_types, else every full_attention_interval-th layer is full attention."""
    if "layer_types" in hf:
        return list(hf["layer_types"])
    interval = hf.get("full_attention_interval", 4)
    return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(hf["num_hidden_layers"])]


def is_moe(hf: dict) -> bool:
    return bool(hf.get("num_experts"))


def config_fields(hf: dict) -> dict:
    if hf.get("attention_bias"):
        raise ValueError("qwen3_5 with attention_bias=true is not supported (the released models have none)")
    kinds = layer_types(hf)
    fields = {
        **qwen2.fields_without_dense_mlp(hf),
        # Every layer of Qwen3.5-MoE is MoE and its config.json has no intermediate_size: megatron-core's
        # ffn_hidden_size (read by dense layers only) is the experts' size there.
        "ffn_hidden_size": hf["moe_intermediate_size"] if is_moe(hf) else hf["intermediate_size"],
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "layernorm_zero_centered_gamma": True,
        "attention_output_gate": True,
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": [1 if kind == LINEAR_ATTENTION else 0 for kind in kinds],
        "linear_conv_kernel_dim": hf["linear_conv_kernel_dim"],
        "linear_key_head_dim": hf["linear_key_head_dim"],
        "linear_value_head_dim": hf["linear_value_head_dim"],
        "linear_num_key_heads": hf["linear_num_key_heads"],
        "linear_num_value_heads": hf["linear_num_value_heads"],
    }
    if is_moe(hf):
        fields.update(
            num_moe_experts=hf["num_experts"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_router_topk=hf["num_experts_per_tok"],
            moe_router_pre_softmax=False,
        )
        if hf.get("shared_expert_intermediate_size"):
            fields.update(
                moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                moe_shared_expert_gate=True,
            )
    return fields


def rotary_percent(hf: dict) -> float:
    """Qwen3.5 rotates only the first partial_rotary_factor of each head's dims."""
    rope = hf.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))


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
    if not is_moe(hf):
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
    return qwen2.dense_mlp_rules("model.layers.{layer}.mlp.experts.{expert}.") if is_moe(hf) else {}
