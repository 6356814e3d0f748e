"""Qwen2 (dense): HF <-> Megatron names and layouts (its architecture fields: relax.hf_checkpoint.architecture).

Qwen2 attention has q/k/v biases and no q/k norm; MLP is SwiGLU; norms are RMSNorm.
"""

from relax.train.model.layouts import Rule


def top_level_rules(hf: dict) -> dict[str, Rule]:
    """Rules for the parameters outside the layers. A tied lm_head is the embedding itself."""
    lm_head = "model.embed_tokens.weight" if hf.get("tie_word_embeddings") else "lm_head.weight"
    return {
        "embedding.word_embeddings.weight": Rule("column", ("model.embed_tokens.weight",)),
        "decoder.final_layernorm.weight": Rule("replicated", ("model.norm.weight",)),
        "output_layer.weight": Rule("column", (lm_head,)),
    }


def attention_rules(hf: dict, qkv_bias: bool, qk_norm: bool) -> dict[str, Rule]:
    """Rules of one layer's attention block ({layer} is the HF layer index); shared by the Qwen families."""
    prefix = "model.layers.{layer}.self_attn."
    rules = {
        "input_layernorm.weight": Rule("replicated", ("model.layers.{layer}.input_layernorm.weight",)),
        "self_attention.linear_qkv.weight": Rule("qkv", tuple(f"{prefix}{p}_proj.weight" for p in "qkv")),
        "self_attention.linear_proj.weight": Rule("row", (prefix + "o_proj.weight",)),
        "pre_mlp_layernorm.weight": Rule("replicated", ("model.layers.{layer}.post_attention_layernorm.weight",)),
    }
    if qkv_bias:
        rules["self_attention.linear_qkv.bias"] = Rule("qkv", tuple(f"{prefix}{p}_proj.bias" for p in "qkv"))
    if qk_norm:
        rules["self_attention.q_layernorm.weight"] = Rule("replicated", (prefix + "q_norm.weight",))
        rules["self_attention.k_layernorm.weight"] = Rule("replicated", (prefix + "k_norm.weight",))
    return rules


def dense_mlp_rules(hf_prefix: str) -> dict[str, Rule]:
    """SwiGLU MLP rules, Megatron names relative to the MLP module, HF names under `hf_prefix`."""
    return {
        "linear_fc1.weight": Rule("gate_up", (hf_prefix + "gate_proj.weight", hf_prefix + "up_proj.weight")),
        "linear_fc2.weight": Rule("row", (hf_prefix + "down_proj.weight",)),
    }


def layer_rules(hf: dict) -> dict[str, Rule]:
    """Rules for one decoder layer, Megatron names relative to `decoder.layers.{i}.`."""
    mlp = {"mlp." + name: rule for name, rule in dense_mlp_rules("model.layers.{layer}.mlp.").items()}
    return {**attention_rules(hf, qkv_bias=True, qk_norm=False), **mlp}


def expert_rules(hf: dict) -> dict[str, Rule]:
    return {}


def block_spec(config, hf: dict):
    """megatron-core's local layer spec, the same for every layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm, normalization=config.normalization
    )
