"""Qwen3-MoE: Qwen3 attention; every layer's MLP is a top-k softmax router over SwiGLU experts.

Megatron's router takes the top k logits and softmaxes over them, which is HF's norm_topk_prob=True;
norm_topk_prob=False (softmax over all experts, then top k) is moe_router_pre_softmax=True.
"""

from relax.train.model import qwen2, qwen3
from relax.train.model.layouts import Rule

MODEL_TYPES = ("qwen3_moe",)
top_level_rules = qwen2.top_level_rules


def num_experts(hf: dict) -> int:
    """transformers 5 writes num_local_experts, 4.x num_experts."""
    return hf["num_local_experts"] if "num_local_experts" in hf else hf["num_experts"]


def config_fields(hf: dict) -> dict:
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ValueError(
            "qwen3_moe with dense layers among the MoE ones (decoder_sparse_step != 1 or mlp_only_layers) is "
            f"not supported: decoder_sparse_step={hf.get('decoder_sparse_step')}, "
            f"mlp_only_layers={hf.get('mlp_only_layers')}"
        )
    return {
        **qwen3.config_fields(hf),
        "num_moe_experts": num_experts(hf),
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_router_topk": hf["num_experts_per_tok"],
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
    }


def layer_rules(hf: dict) -> dict[str, Rule]:
    attention = qwen2.attention_rules(hf, qkv_bias=bool(hf.get("attention_bias", False)), qk_norm=True)
    return {**attention, "mlp.router.weight": Rule("replicated", ("model.layers.{layer}.mlp.gate.weight",))}


def expert_rules(hf: dict) -> dict[str, Rule]:
    """Rules for one expert, Megatron names relative to `mlp.experts.local_experts.{i}.`."""
    return qwen2.dense_mlp_rules("model.layers.{layer}.mlp.experts.{expert}.")
