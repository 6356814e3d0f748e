"""relax/train/model/checkpoint_layout.py: the language model of a Qwen3.5 vision-language checkpoint (config and
tensor names), the frozen tensors, and the dry run of such a checkpoint."""

import json

import pytest
import torch
import transformers

from relax.args import format_config, parse_train_args
from relax.tiny_model import build_tiny_model
from relax.train.model import family_of, qwen3_5
from relax.train.model.checkpoint_layout import (
    checkpoint_layout,
    describe_frozen,
    is_frozen,
    per_expert_shapes,
    trained_names,
)

RUN = ["--lr", "1e-6", "--prompt-data", "prompts.jsonl", "--reward-fn", "math", "--device", "cpu", "--dry-run"]


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    families = ("qwen3_5_vl", "qwen3_5_moe_vl")
    return {family: build_tiny_model(tmp_path_factory.mktemp(family), family) for family in families}


def test_a_text_config_is_its_own_language_model():
    text = {"model_type": "qwen3", "tie_word_embeddings": True}
    layout = checkpoint_layout(text)
    assert layout.text_config is text and not layout.vision_language
    assert layout.checkpoint_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"


def test_a_vision_language_config_gives_its_text_config_with_the_top_level_tie():
    config = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": {"model_type": "qwen3_5_text",
                                                                                       "tie_word_embeddings": False}}
    layout = checkpoint_layout(config)
    assert layout.vision_language and layout.text_config == {"model_type": "qwen3_5_text", "tie_word_embeddings": True}
    assert family_of(config) is qwen3_5
    assert layout.checkpoint_name("model.norm.weight") == "model.language_model.norm.weight"
    assert layout.checkpoint_name("lm_head.weight") == "lm_head.weight"
    # transformers' default for a Qwen3_5Config without the field: untied, whatever text_config says.
    del config["tie_word_embeddings"]
    config["text_config"]["tie_word_embeddings"] = True
    assert checkpoint_layout(config).text_config["tie_word_embeddings"] is False


def test_other_multimodal_configs_and_mismatched_text_configs_are_refused():
    with pytest.raises(ValueError, match="model_type 'qwen3_vl'.*supported model types with a text_config"):
        checkpoint_layout({"model_type": "qwen3_vl", "text_config": {"model_type": "qwen3_vl_text"}})
    with pytest.raises(ValueError, match="text_config of model_type 'qwen3_text'; expected 'qwen3_5_moe_text'"):
        checkpoint_layout({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_text"}})


def test_vision_tower_and_mtp_are_frozen_and_named_in_one_line():
    names = ["lm_head.weight", "model.language_model.norm.weight", "model.visual.pos_embed.weight",
             "model.visual.merger.norm.weight", "mtp.fc.weight"]
    assert [is_frozen(n) for n in names] == [False, False, True, True, True]
    assert trained_names(names) == {"lm_head.weight", "model.language_model.norm.weight"}
    assert describe_frozen(names) == (
        "3 checkpoint tensors are kept frozen (not trained, not sent to engines): "
        "model.visual.* (vision tower): 2, mtp.* (multi-token prediction): 1"
    )
    assert describe_frozen(names[:2]) == ""


def test_tiny_vision_language_checkpoints_are_laid_out_as_the_released_ones(vl_dirs):
    from safetensors import safe_open

    for family, directory in vl_dirs.items():
        config = json.loads((directory / "config.json").read_text())
        assert config["model_type"] == family.removesuffix("_vl") and "vision_config" in config
        assert config["text_config"]["rope_parameters"]["mrope_section"]
        with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
        prefixes = ("model.language_model.", "model.visual.", "mtp.", "lm_head.weight")
        assert all(name.startswith(prefixes) for name in names), names
        assert all(any(name.startswith(prefix) for name in names) for prefix in prefixes), names
    # Like Qwen/Qwen3.5-35B-A3B: no dense intermediate_size in text_config, each layer's experts in two tensors.
    assert "intermediate_size" not in json.loads((vl_dirs["qwen3_5_moe_vl"] / "config.json").read_text())["text_config"]
    with safe_open(str(vl_dirs["qwen3_5_moe_vl"] / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape() == [4, 64, 64]
        assert not any(".experts.0." in name for name in f.keys())


def test_fused_experts_read_as_the_per_expert_tensors_transformers_saves(vl_dirs, tmp_path):
    """The fused tiny MoE checkpoint, loaded by transformers and read per expert by relax, holds the tensors
    transformers writes one per expert (save_pretrained of a model built from per-expert tensors)."""
    from relax.train.model import HFCheckpoint

    fused = HFCheckpoint(vl_dirs["qwen3_5_moe_vl"])
    model = transformers.AutoModelForImageTextToText.from_pretrained(vl_dirs["qwen3_5_moe_vl"], dtype=torch.float32)
    experts = model.model.language_model.layers[1].mlp.experts  # transformers' own fused parameters
    for j in range(4):
        prefix = f"model.language_model.layers.1.mlp.experts.{j}."
        gate, up = experts.gate_up_proj[j].detach().chunk(2)
        assert torch.equal(fused.get(prefix + "gate_proj.weight"), gate)
        assert torch.equal(fused.get(prefix + "up_proj.weight"), up)
        assert torch.equal(fused.get(prefix + "down_proj.weight"), experts.down_proj[j].detach())
        assert fused.shape(prefix + "gate_proj.weight") == [32, 64]
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" not in fused.names()
    shapes = per_expert_shapes({"x.mlp.experts.gate_up_proj": (2, 8, 4), "x.mlp.experts.down_proj": (2, 4, 4)})
    assert shapes == {
        "x.mlp.experts.0.gate_proj.weight": (4, 4), "x.mlp.experts.0.up_proj.weight": (4, 4),
        "x.mlp.experts.1.gate_proj.weight": (4, 4), "x.mlp.experts.1.up_proj.weight": (4, 4),
        "x.mlp.experts.0.down_proj.weight": (4, 4), "x.mlp.experts.1.down_proj.weight": (4, 4),
    }


@pytest.mark.parametrize("family", ["qwen3_5_vl", "qwen3_5_moe_vl"])
def test_the_dry_run_of_a_vision_language_checkpoint_shows_its_language_model(vl_dirs, family):
    config = parse_train_args([*RUN, "--hf-checkpoint", str(vl_dirs[family])])
    text = json.loads((vl_dirs[family] / "config.json").read_text())["text_config"]
    tc = config.megatron.transformer
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads) == (
        text["num_hidden_layers"], text["hidden_size"], text["num_attention_heads"]
    )
    assert tc.experimental_attention_variant == "gated_delta_net" and tc.linear_attention_freq == [1, 1, 1, 0]
    assert config.megatron.model.vocab_size == text["vocab_size"]
    assert config.megatron.model.rotary_percent == 0.25
    printed = format_config(config)
    assert f"num_layers = {text['num_hidden_layers']}" in printed and "gated_delta_net" in printed
    if family == "qwen3_5_moe_vl":  # all-MoE: the dense FFN size megatron-core keeps is the experts'
        assert tc.num_moe_experts == text["num_experts"]
        assert tc.ffn_hidden_size == tc.moe_ffn_hidden_size == text["moe_intermediate_size"]
