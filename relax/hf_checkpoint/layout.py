"""Where the language model sits in an HF checkpoint, and which of its tensors relax leaves untouched.

relax.train.model's family modules (qwen2.py, qwen3_5.py, ...) name tensors as a text-only checkpoint does ("text
names"): `model.embed_tokens.weight`, `model.layers.{i}.*`, `model.norm.weight`, `lm_head.weight`. Two layouts hold
them:

- text: config.json is the language model's (Qwen3ForCausalLM, Qwen3_5ForCausalLM, ...); checkpoint names are
  the text names.
- vision-language: Qwen3.5 as published (Qwen/Qwen3.5-9B: model_type "qwen3_5", Qwen3_5ForConditionalGeneration;
  Qwen/Qwen3.5-35B-A3B: "qwen3_5_moe", Qwen3_5MoeForConditionalGeneration). The language model's fields are
  config.json's text_config (model_type qwen3_5_text / qwen3_5_moe_text), except tie_word_embeddings, which
  transformers and SGLang read from the top level; its tensors are `model.language_model.*` and `lm_head.weight`
  (transformers 5.19 modeling_qwen3_5.py: Qwen3_5ForConditionalGeneration.model.language_model; SGLang 0.5.23
  models/qwen3_5.py loads these names).

relax trains the language model only. Tensors under FROZEN_PREFIXES (the vision tower, the multi-token-prediction
head) are frozen in either layout: loading names them and skips them, exports leave them out, the engine's
completeness check does not wait for them, and save_hf (--save-hf, relax convert) copies them into its output
unchanged. Any other tensor the family does not map is still an error.

Fused experts: Qwen/Qwen3.5-35B-A3B stores each layer's routed experts as two tensors (transformers 5's layout),
`...mlp.experts.gate_up_proj` [experts, 2 x moe_intermediate, hidden] (gate rows, then up rows) and
`...mlp.experts.down_proj` [experts, hidden, moe_intermediate]. relax reads them as the per-expert tensors the
family maps (`...mlp.experts.{j}.gate_proj.weight`, ...; per_expert_views) and sends and writes per-expert
tensors, which SGLang's and transformers' Qwen3.5-MoE loaders read as well.
"""

import re
from collections import Counter
from dataclasses import dataclass

from relax.hf_checkpoint.architecture import FAMILIES

# config.json model_type of a vision-language checkpoint -> the text_config model_type relax trains.
VISION_LANGUAGE_MODEL_TYPES = {
    family.vision_language[0]: family.model_type for family in FAMILIES.values() if family.vision_language
}
LANGUAGE_MODEL_PREFIX = "model.language_model."
FROZEN_PREFIXES = {"model.visual.": "vision tower", "mtp.": "multi-token prediction"}
# Fields of the whole model that its language model follows (transformers ties lm_head by the top-level value).
INHERITED_FIELDS = {"tie_word_embeddings": False}


def language_model(config: dict) -> tuple[dict, bool]:
    """(the language model's config as a text-only config.json would hold it, whether the checkpoint is a
    vision-language one) from a checkpoint's config.json; a text config passes through unchanged."""
    if "text_config" not in config:
        return config, False
    model_type = config.get("model_type")
    if model_type not in VISION_LANGUAGE_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} (architectures {config.get('architectures')}) is a multimodal config relax "
            f"does not read; supported model types with a text_config (relax trains their language model): "
            f"{sorted(VISION_LANGUAGE_MODEL_TYPES)}"
        )
    text = dict(config["text_config"])
    expected = VISION_LANGUAGE_MODEL_TYPES[model_type]
    if text.get("model_type", expected) != expected:
        raise ValueError(
            f"model_type {model_type!r} has a text_config of model_type {text['model_type']!r}; expected {expected!r}"
        )
    text["model_type"] = expected
    text.update({field: config.get(field, default) for field, default in INHERITED_FIELDS.items()})
    return text, True


def checkpoint_name(text_name: str, vision_language: bool) -> str:
    """The checkpoint's name of a tensor the family names `text_name`."""
    if vision_language and text_name.startswith("model."):
        return LANGUAGE_MODEL_PREFIX + text_name[len("model.") :]
    return text_name


_FUSED_EXPERTS = re.compile(r"(.+\.mlp\.experts\.)(gate_up_proj|down_proj)")


@dataclass(frozen=True)
class ExpertView:
    """A per-expert tensor inside a fused experts tensor: fused[expert][rows]."""

    fused_name: str
    expert: int
    rows: slice
    shape: tuple[int, ...]


def per_expert_views(name: str, shape) -> dict[str, ExpertView]:
    """The per-expert tensors of a fused experts tensor `name` of `shape`; empty for any other tensor."""
    match = _FUSED_EXPERTS.fullmatch(name)
    if match is None:
        return {}
    prefix, kind = match.groups()
    experts, rows, columns = shape
    if kind == "down_proj":
        whole = slice(None)
        return {f"{prefix}{j}.down_proj.weight": ExpertView(name, j, whole, (rows, columns)) for j in range(experts)}
    half = rows // 2
    return {
        f"{prefix}{j}.{part}_proj.weight": ExpertView(name, j, slice(start, start + half), (half, columns))
        for j in range(experts)
        for part, start in (("gate", 0), ("up", half))
    }


def is_frozen(name: str) -> bool:
    return name.startswith(tuple(FROZEN_PREFIXES))


def trained_names(names) -> set[str]:
    """The checkpoint tensors the actor trains (and sends to the engines): all but the frozen ones."""
    return {name for name in names if not is_frozen(name)}


def describe_frozen(names) -> str:
    """One line saying how many tensors under which prefixes stay frozen; empty when there are none."""
    counts = Counter(prefix for name in names for prefix in FROZEN_PREFIXES if name.startswith(prefix))
    if not counts:
        return ""
    parts = ", ".join(f"{prefix}* ({FROZEN_PREFIXES[prefix]}): {count}" for prefix, count in sorted(counts.items()))
    return f"{sum(counts.values())} checkpoint tensors are kept frozen (not trained, not sent to engines): {parts}"
