"""Tiny random HF checkpoints (config.json + safetensors + tokenizer), built locally with no download.

They are what the tiny CPU run and the tests use: real HF formats that SGLang, megatron-core (through
relax's mappings) and transformers all load. The tokenizer is character-level over a small alphabet, so
synthetic tasks (digits, letters, arithmetic) have one token per character and short sequences.
"""

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ALPHABET = list("0123456789abcdefghijklmnopqrstuvwxyz+-*/=()<>,.:?! \n")

# ChatML, as the Qwen families use, reduced to what a character-level tokenizer needs.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Shapes small enough for a CPU step in milliseconds, but with every structural feature of the family
# (GQA, qk-norm, MoE routing, hybrid GDN/full-attention layers).
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_HYBRID_GDN = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    full_attention_interval=4,  # SGLang 0.5.23 reads the layer kinds from this, HF from layer_types
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(**_MOE, norm_topk_prob=True),
    ),
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, _HYBRID_GDN),
    "qwen3_5_moe": (
        transformers.Qwen3_5MoeTextConfig,
        transformers.Qwen3_5MoeForCausalLM,
        dict(**_HYBRID_GDN, **_MOE, shared_expert_intermediate_size=32),
    ),
    "qwen3_next": (
        transformers.Qwen3NextConfig,
        transformers.Qwen3NextForCausalLM,
        dict(**_HYBRID_GDN, **_MOE, shared_expert_intermediate_size=32),
    ),
}


def _byte_level_symbol(char: str) -> str:
    """The symbol byte-level BPE uses for an ASCII character: printable ones stand for themselves, the
    33 control/space bytes are shifted past 255 (so " " is "Ġ" and "\\n" is "Ċ")."""
    code = ord(char)
    if 33 <= code <= 126:
        return char
    if code <= 32:
        return chr(256 + code)
    raise ValueError(f"tiny tokenizer alphabet is ASCII only, got {char!r}")


def build_tokenizer(out_dir: str | Path) -> transformers.PreTrainedTokenizerFast:
    """A character-level byte-level BPE tokenizer (no merges) saved in HF format.

    Byte-level BPE like the real Qwen tokenizers, because transformers rebuilds a Qwen2Tokenizer from
    vocab + merges for model_type qwen2 whatever tokenizer.json says; any other layout loses whitespace.
    """
    symbols = [_byte_level_symbol(char) for char in ALPHABET]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + symbols + ["<pad>"])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_tiny_model(out_dir: str | Path, family: str = "qwen3", seed: int = 0, **config_overrides) -> Path:
    """Write a random tiny model of `family` with its tokenizer to `out_dir` and return the directory."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {sorted(FAMILIES)}")
    config_cls, model_cls, family_fields = FAMILIES[family]
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir)
    config = config_cls(
        **{**_COMMON, **family_fields, **config_overrides},
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    transformers.GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out_dir)
    (out_dir / "relax_tiny_model.json").write_text(json.dumps({"family": family, "seed": seed}))
    return out_dir


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random HF checkpoint with its tokenizer.")
    parser.add_argument("--family", default="qwen3", choices=sorted(FAMILIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="directory to write (created if missing)")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out, args.family, args.seed))


if __name__ == "__main__":
    main()
