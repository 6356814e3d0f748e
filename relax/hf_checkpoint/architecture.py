"""What a language model's config.json fixes in Megatron: the TransformerConfig fields and the GPTModel-level
settings, one function per model family. This is the only mapping from config.json to Megatron: the parser
merges it with the flags (relax.args), the training actor builds its model with it (relax.train.model), and
a resumed run and `relax convert` compare it with the saved checkpoint's (relax.train.saved_steps).

Each function takes the language model's config (text_config for a vision-language checkpoint, layout.py). A
field the family needs and config.json lacks raises KeyError naming it; a configuration relax cannot build
raises ValueError (read_hf_checkpoint turns both into HFCheckpointError naming the file). FAMILIES: one record per
family.
"""

from collections.abc import Callable
from dataclasses import dataclass

# HF layer_types values of the hybrid families (Qwen3.5, Qwen3-Next).
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


def qwen2(hf: dict) -> dict:
    """Qwen2 (dense): q/k/v biases, no q/k norm, SwiGLU MLP, RMSNorm."""
    return {**_qwen2_without_dense_mlp(hf), "ffn_hidden_size": hf["intermediate_size"]}


def _qwen2_without_dense_mlp(hf: dict) -> dict:
    """qwen2's fields but the dense MLP's size, which an all-MoE model (Qwen3.5-MoE) has not got."""
    import torch.nn.functional as F

    num_heads = hf["num_attention_heads"]
    return dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=num_heads,
        num_query_groups=hf.get("num_key_value_heads", num_heads),
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        qk_layernorm=False,
    )


def qwen3(hf: dict) -> dict:
    """Qwen3 (dense): Qwen2 with q/k RMSNorm per head and, by default, no attention biases."""
    return {**qwen2(hf), "add_qkv_bias": bool(hf.get("attention_bias", False)), "qk_layernorm": True}


def qwen3_moe_experts(hf: dict) -> int:
    """transformers 5 writes num_local_experts, 4.x num_experts."""
    return hf["num_local_experts"] if "num_local_experts" in hf else hf["num_experts"]


def qwen3_moe(hf: dict) -> dict:
    """Qwen3-MoE: every layer's MLP is a top-k router over SwiGLU experts. Megatron's router takes the top k
    logits and softmaxes over them, which is HF's norm_topk_prob=True; norm_topk_prob=False (softmax over all
    experts, then top k) is moe_router_pre_softmax=True."""
    _refuse_dense_layers_among_moe(hf)
    return {
        **qwen3(hf),
        "num_moe_experts": qwen3_moe_experts(hf),
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_router_topk": hf["num_experts_per_tok"],
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
    }


def layer_types(hf: dict) -> list[str]:
    """Per-layer kind of a hybrid model: HF's layer_types, else every full_attention_interval-th layer is full
    attention."""
    if "layer_types" in hf:
        return list(hf["layer_types"])
    interval = hf.get("full_attention_interval", 4)
    return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(hf["num_hidden_layers"])]


def qwen3_5_is_moe(hf: dict) -> bool:
    return bool(hf.get("num_experts"))


def qwen3_5(hf: dict) -> dict:
    """Qwen3.5 (dense and MoE): hybrid Gated DeltaNet / gated full-attention layers, RMSNorms scaling by
    (1 + weight); MoE layers normalise the top-k router probabilities (moe_router_pre_softmax=False)."""
    if hf.get("attention_bias"):
        raise ValueError("qwen3_5 with attention_bias=true is not supported (the released models have none)")
    fields = {
        **_qwen2_without_dense_mlp(hf),
        # Every layer of Qwen3.5-MoE is MoE and its config.json has no intermediate_size: megatron-core's
        # ffn_hidden_size (read by dense layers only) is the experts' size there.
        "ffn_hidden_size": hf["moe_intermediate_size"] if qwen3_5_is_moe(hf) else hf["intermediate_size"],
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "layernorm_zero_centered_gamma": True,
        "attention_output_gate": True,
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": [1 if kind == LINEAR_ATTENTION else 0 for kind in layer_types(hf)],
        "linear_conv_kernel_dim": hf["linear_conv_kernel_dim"],
        "linear_key_head_dim": hf["linear_key_head_dim"],
        "linear_value_head_dim": hf["linear_value_head_dim"],
        "linear_num_key_heads": hf["linear_num_key_heads"],
        "linear_num_value_heads": hf["linear_num_value_heads"],
    }
    if qwen3_5_is_moe(hf):
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


def qwen3_next(hf: dict) -> dict:
    """Qwen3-Next: Qwen3.5-MoE's hybrid layers; the router softmax follows norm_topk_prob as in qwen3_moe."""
    _refuse_dense_layers_among_moe(hf)
    return {**qwen3_5(hf), "moe_router_pre_softmax": not hf.get("norm_topk_prob", True)}


def _refuse_dense_layers_among_moe(hf: dict) -> None:
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ValueError(
            f"{hf.get('model_type')} with dense layers among the MoE ones (decoder_sparse_step != 1 or "
            f"mlp_only_layers) is not supported: decoder_sparse_step={hf.get('decoder_sparse_step')}, "
            f"mlp_only_layers={hf.get('mlp_only_layers')}"
        )


@dataclass(frozen=True)
class Family:
    """One model family relax trains: what its config.json fixes in Megatron, where its HF <-> Megatron tensor names
    are, and the facts the actor's model follows. FAMILIES holds one per language-model model_type."""

    model_type: str  # the language model's config.json model_type (text_config's in a vision-language checkpoint)
    architecture: str  # the HF model class of a text checkpoint (config.json architectures), SGLang's model too
    fields: Callable[[dict], dict]  # config.json -> the TransformerConfig fields it fixes
    # The relax.train.model module with its tensor names and layer spec (relax.train.model.FamilyNames), named
    # rather than imported: the train side builds on this package, not the other way
    names: str
    partial_rotary: bool = False  # rotates only the first partial_rotary_factor of each head's dims
    gated_delta_net: bool = False  # hybrid Gated DeltaNet / full-attention layers (layer_types)
    # (model_type, HF model class) of the published vision-language checkpoint holding this family as text_config
    vision_language: tuple[str, str] | None = None


FAMILIES = {
    family.model_type: family
    for family in (
        Family("qwen2", "Qwen2ForCausalLM", qwen2, names="qwen2"),
        Family("qwen3", "Qwen3ForCausalLM", qwen3, names="qwen3"),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", qwen3_moe, names="qwen3_moe"),
        Family(
            "qwen3_5_text", "Qwen3_5ForCausalLM", qwen3_5, names="qwen3_5", partial_rotary=True,
            gated_delta_net=True, vision_language=("qwen3_5", "Qwen3_5ForConditionalGeneration"),
        ),
        Family(
            "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", qwen3_5, names="qwen3_5", partial_rotary=True,
            gated_delta_net=True, vision_language=("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
        ),
        Family(
            "qwen3_next", "Qwen3NextForCausalLM", qwen3_next, names="qwen3_next", partial_rotary=True,
            gated_delta_net=True,
        ),
    )
}


def transformer_fields(hf: dict) -> dict:
    """TransformerConfig fields config.json fixes. Dropouts are those of the Qwen checkpoints' configs."""
    if hf.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
    return {
        **FAMILIES[hf["model_type"]].fields(hf),
        "hidden_dropout": 0.0,
        "attention_dropout": float(hf.get("attention_dropout", 0.0)),
    }


def model_fields(hf: dict) -> dict:
    """GPTModel-level settings config.json fixes, by their Megatron flag names."""
    return {
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf["max_position_embeddings"],
        "rotary_base": _rope_theta(hf),
        "rotary_percent": _rotary_percent(hf) if FAMILIES[hf["model_type"]].partial_rotary else 1.0,
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
    }


def _rope_theta(hf: dict) -> float:
    """RoPE base; only plain RoPE is supported (transformers 5 writes rope_parameters, 4.x rope_theta)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported yet (only 'default' RoPE): {rope}")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _rotary_percent(hf: dict) -> float:
    rope = hf.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
