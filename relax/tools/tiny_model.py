"""Tiny random HF checkpoints (config.json + safetensors + tokenizer), built locally with no download.

They are what the tiny CPU run and the tests use: real HF formats that SGLang, megatron-core (through
relax's mappings) and transformers all load. The tokenizer is character-level over a small alphabet, so
synthetic tasks (digits, letters, arithmetic) have one token per character and short sequences.
"""

import json
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from relax.hf_checkpoint.architecture import FAMILIES as FAMILY_RECORDS

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ALPHABET = list("0123456789abcdefghijklmnopqrstuvwxyz+-*/=()<>,.:?! \n")

# ChatML, as the Qwen families use, reduced to what a character-level tokenizer needs.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The tool-chat tokenizer (build_tiny_model(..., tool_chat=True)): Qwen3's chat format for tool use and thinking,
# over every printable ASCII character, so a tiny model can write tool-call JSON. Its template writes what Qwen3's
# writes: the tools' JSON schemas in the system turn; tool calls as <tool_call>\n{"name": ..., "arguments": ...}\n
# </tool_call> inside the assistant turn; each tool result as <tool_response> inside one user turn, consecutive
# tool messages merged into it; a thinking block kept (and normalised) only for assistant turns after the last
# user message; an empty thinking block opening the answer when thinking is turned off.
TOOL_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOL_CHAT_ALPHABET = [chr(code) for code in range(32, 127)] + ["\n"]
# No whitespace control in it: HF renders with trim_blocks, so a newline right after a tag is written {{ '\\n' }}.
TOOL_CHAT_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nCall a tool with <tool_call>\n{\"name\": <tool name>, \"arguments\": <arguments object>}\n"
    "</tool_call>. The tools:\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "{% set content = message.content or '' %}{% set thought = '' %}"
    "{% if '</think>' in content %}"
    "{% set thought = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user and (loop.last or thought) %}<think>\n{{ thought }}\n</think>\n\n{% endif %}"
    "{{ content }}"
    "{% for call in message.tool_calls or [] %}{% if content or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
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
# Qwen3-1.7B's body (config.json of the released model) for the tiny tokenizer: 1.4B parameters without the
# 151,936-token embedding. The GPU tests and benchmarks build it on the device.
QWEN3_1_7B_BODY = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=40960,
)
# Qwen3.5-9B's layer shapes (config.json of the released model) for the tiny tokenizer, GDN layers three in four
# (full_attention_interval 4): `qwen3_5_9b_layers(8)` has 6 GDN and 2 full-attention layers.
def qwen3_5_9b_layers(num_layers: int) -> dict:
    return dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=num_layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (num_layers // 4), full_attention_interval=4,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=4096,
    )


_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# Tiny family name -> (the model_type of its relax.hf_checkpoint.architecture.FAMILIES record, which names the
# transformers class to build, and the config fields the tiny model adds to _COMMON).
FAMILIES = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", dict(**_MOE, norm_topk_prob=True)),
    "qwen3_5": ("qwen3_5_text", _HYBRID_GDN),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(**_HYBRID_GDN, **_MOE, shared_expert_intermediate_size=32)),
    "qwen3_next": ("qwen3_next", dict(**_HYBRID_GDN, **_MOE, shared_expert_intermediate_size=32)),
}

# Vision-language checkpoints laid out as Qwen3.5 is published (Qwen3_5ForConditionalGeneration: config.json with
# text_config + vision_config, tensors model.language_model.*, model.visual.*, lm_head.weight, mtp.*): the text
# family's fields under text_config (rope_parameters with an interleaved mrope_section, as the released configs
# have; an MoE text_config without intermediate_size and each layer's experts fused in two tensors, as
# Qwen3.5-35B-A3B's) and a one-block vision tower. One "<family>_vl" for each family whose record has a
# vision-language checkpoint.
VISION_LANGUAGE_FAMILIES = {
    f"{name}_vl": name for name, (model_type, _) in FAMILIES.items() if FAMILY_RECORDS[model_type].vision_language
}
_TINY_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
    spatial_merge_size=2, num_position_embeddings=16, out_hidden_size=_COMMON["hidden_size"],
)
_MROPE = dict(
    rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[1, 1, 0], mrope_interleaved=True
)
ALL_FAMILIES = sorted([*FAMILIES, *VISION_LANGUAGE_FAMILIES])


def _byte_level_symbol(char: str) -> str:
    """The symbol byte-level BPE uses for an ASCII character: printable ones stand for themselves, the
    33 control/space bytes are shifted past 255 (so " " is "Ġ" and "\\n" is "Ċ")."""
    code = ord(char)
    if 33 <= code <= 126:
        return char
    if code <= 32:
        return chr(256 + code)
    raise ValueError(f"tiny tokenizer alphabet is ASCII only, got {char!r}")


def build_tokenizer(out_dir: str | Path, tool_chat: bool = False) -> transformers.PreTrainedTokenizerFast:
    """A character-level byte-level BPE tokenizer saved in HF format; with `tool_chat`, over printable ASCII with
    Qwen3's tool and thinking tokens (not special: a decode keeps them, as Qwen3's does), its tool-chat template,
    and one merge, "\\n\\n" (Qwen's vocabulary has it too): text has more than one tokenization, so a model can
    sample ids that re-tokenizing its text would not give back.

    Byte-level BPE like the real Qwen tokenizers, because transformers rebuilds a Qwen2Tokenizer from
    vocab + merges for model_type qwen2 whatever tokenizer.json says; any other layout loses whitespace.
    """
    alphabet, merges = (TOOL_CHAT_ALPHABET, [("Ċ", "Ċ")]) if tool_chat else (ALPHABET, [])
    added = TOOL_TOKENS if tool_chat else []
    symbols = [_byte_level_symbol(char) for char in alphabet] + ["".join(pair) for pair in merges]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + added + symbols + ["<pad>"])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_tokens([AddedToken(token, special=False, normalized=False) for token in added])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS,
        chat_template=TOOL_CHAT_TEMPLATE if tool_chat else CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_tiny_model(
    out_dir: str | Path, family: str = "qwen3", seed: int = 0, *, device: str = "cpu", dtype=torch.float32,
    tool_chat: bool = False, **config_overrides,
) -> Path:
    """Write a random tiny model of `family` with its tokenizer to `out_dir` and return the directory.
    `tool_chat`: the tool-chat tokenizer (build_tokenizer), for multi-turn tool use.
    For a vision-language family, `config_overrides` go to its text_config. `device`: where the weights are
    initialised (a GPU makes a billion-parameter body, QWEN3_1_7B_BODY, in seconds); `dtype`: as saved."""
    if family not in ALL_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {ALL_FAMILIES}")
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir, tool_chat)
    token_ids = dict(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if family in VISION_LANGUAGE_FAMILIES:
        model_type, family_fields = FAMILIES[VISION_LANGUAGE_FAMILIES[family]]
        model_cls = getattr(transformers, FAMILY_RECORDS[model_type].vision_language[1])
        text_fields = {**_COMMON, **family_fields, "rope_parameters": _MROPE, **config_overrides}
        if "num_experts" in text_fields:
            del text_fields["intermediate_size"]
        config = model_cls.config_class(
            text_config={**text_fields, **token_ids}, vision_config=_TINY_VISION, tie_word_embeddings=False
        )
    else:
        model_type, family_fields = FAMILIES[family]
        model_cls = getattr(transformers, FAMILY_RECORDS[model_type].architecture)
        config = model_cls.config_class(**{**_COMMON, **family_fields, **config_overrides}, **token_ids)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config).to(dtype)
    # HF initialises the pad token's embedding row to zeros (padding_idx); released checkpoints have a trained one.
    # A zero row sampled into a response meets RMSNorm at zero, whose gradient there is 1/sqrt(eps) = 1000x: the
    # actor's first gradient norm was 1e3 (tiny) to 1e7 (300M), all in that row. So it is drawn like the others.
    with torch.no_grad():
        pad_row = model.get_input_embeddings().weight[tokenizer.pad_token_id]
        pad_row.normal_(0.0, config.get_text_config().initializer_range)
    model.save_pretrained(out_dir, safe_serialization=True)
    if family in VISION_LANGUAGE_FAMILIES:
        _lay_out_as_released(out_dir / "model.safetensors", config.text_config)
    transformers.GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out_dir)
    (out_dir / "relax_tiny_model.json").write_text(json.dumps({"family": family, "seed": seed}))
    return out_dir


def _lay_out_as_released(weights_file: Path, text_config) -> None:
    """What save_pretrained writes differs from the released Qwen3.5 checkpoints in two ways, made good here:
    they hold a multi-token-prediction head (mtp.*), which transformers builds no module for (and ignores when
    loading): a few random tensors named as theirs stand in for it; and Qwen3.5-35B-A3B stores each layer's
    experts fused (transformers 5's layout, which it loads as well), where save_pretrained writes one tensor
    per expert: gate_up_proj [experts, 2 x moe_intermediate, hidden] (gate rows first), down_proj
    [experts, hidden, moe_intermediate]."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights_file)
    hidden = text_config.hidden_size
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden)
    for norm in ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        tensors[norm] = torch.randn(hidden)
    for layer in range(text_config.num_hidden_layers if getattr(text_config, "num_experts", None) else 0):
        prefix = f"model.language_model.layers.{layer}.mlp.experts."
        experts = range(text_config.num_experts)
        tensors[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([tensors.pop(f"{prefix}{j}.{part}_proj.weight") for part in ("gate", "up")]) for j in experts]
        )
        tensors[prefix + "down_proj"] = torch.stack([tensors.pop(f"{prefix}{j}.down_proj.weight") for j in experts])
    save_file(tensors, weights_file, metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random HF checkpoint with its tokenizer.")
    parser.add_argument("--family", default="qwen3", choices=ALL_FAMILIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="directory to write (created if missing)")
    args = parser.parse_args(argv)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a bar for writing one small file is noise on a run's console
    print(build_tiny_model(args.out, args.family, args.seed))


if __name__ == "__main__":
    main()
