"""relax/hf_checkpoint: an HF checkpoint read once (config.json, the language model of a Qwen3.5 vision-language
checkpoint, the family and what it fixes in Megatron, tensor names and shapes), the frozen tensors, and the dry
run of a vision-language checkpoint."""

import importlib
import json

import pytest
import torch
import transformers

from helpers import REQUIRED
from relax.args import format_config, parse_train_args
from relax.hf_checkpoint import (
    HFCheckpointError,
    TensorReader,
    describe_frozen,
    is_frozen,
    read_hf_checkpoint,
    trained_names,
)
from relax.hf_checkpoint.architecture import FAMILIES
from relax.hf_checkpoint.layout import language_model
from relax.tools.tiny_model import build_tiny_model

RUN = [*REQUIRED, "--dry-run"]  # the model's size: the --hf-checkpoint's


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    families = ("qwen3_5_vl", "qwen3_5_moe_vl")
    return {family: build_tiny_model(tmp_path_factory.mktemp(family), family) for family in families}


def test_a_text_checkpoint_is_its_own_language_model(tiny_qwen3):
    checkpoint = read_hf_checkpoint(tiny_qwen3)
    assert checkpoint.text_config is checkpoint.config and not checkpoint.vision_language
    assert checkpoint.family == "qwen3"
    assert checkpoint.checkpoint_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    fields = checkpoint.transformer_fields
    assert (fields["num_layers"], fields["hidden_size"], fields["qk_layernorm"]) == (2, 64, True)
    assert checkpoint.model_fields["vocab_size"] == checkpoint.config["vocab_size"]
    # Headers only: names and shapes, as the engines check weight updates against them.
    assert checkpoint.tensor_shapes["model.layers.0.self_attn.q_proj.weight"] == (64, 64)
    assert checkpoint.tensor_shapes["model.layers.1.self_attn.k_norm.weight"] == (16,)


def test_a_vision_language_checkpoint_gives_its_text_config_and_names(vl_dirs):
    checkpoint = read_hf_checkpoint(vl_dirs["qwen3_5_vl"])
    assert checkpoint.vision_language and checkpoint.family == "qwen3_5_text"
    assert checkpoint.text_config["model_type"] == "qwen3_5_text"
    assert checkpoint.checkpoint_name("model.norm.weight") == "model.language_model.norm.weight"
    assert checkpoint.checkpoint_name("lm_head.weight") == "lm_head.weight"
    assert checkpoint.model_fields["rotary_percent"] == 0.25


def test_the_language_model_takes_the_top_level_tie():
    config = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": {"model_type": "qwen3_5_text",
                                                                                       "tie_word_embeddings": False}}
    assert language_model(config) == ({"model_type": "qwen3_5_text", "tie_word_embeddings": True}, True)
    # transformers' default for a Qwen3_5Config without the field: untied, whatever text_config says.
    del config["tie_word_embeddings"]
    config["text_config"]["tie_word_embeddings"] = True
    assert language_model(config)[0]["tie_word_embeddings"] is False


def write_config(directory, config):
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_what_relax_cannot_train_is_one_error_naming_the_file(tmp_path):
    with pytest.raises(HFCheckpointError, match=f"{tmp_path}/config.json does not exist: pass an HF model"):
        read_hf_checkpoint(tmp_path)
    vl = write_config(tmp_path / "vl", {"model_type": "qwen3_vl", "text_config": {"model_type": "qwen3_vl_text"}})
    with pytest.raises(HFCheckpointError, match="vl/config.json: model_type 'qwen3_vl'.*supported model types with"):
        read_hf_checkpoint(vl)
    mismatched = write_config(tmp_path / "mm", {"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3"}})
    with pytest.raises(HFCheckpointError, match="text_config of model_type 'qwen3'; expected 'qwen3_5_moe_text'"):
        read_hf_checkpoint(mismatched)
    llama = write_config(tmp_path / "llama", {"model_type": "llama"})
    with pytest.raises(HFCheckpointError, match="llama/config.json: model_type 'llama'.*supported model types"):
        read_hf_checkpoint(llama)
    config = json.loads((build_tiny_model(tmp_path / "q", "qwen3") / "config.json").read_text())
    del config["intermediate_size"]
    lacking = write_config(tmp_path / "q", config)
    with pytest.raises(HFCheckpointError, match="q/config.json: relax cannot build this qwen3 model: its family "
                                                "mapping reads 'intermediate_size', which config.json lacks"):
        read_hf_checkpoint(lacking)
    no_weights = write_config(tmp_path / "nw", {**config, "intermediate_size": 128})
    with pytest.raises(HFCheckpointError, match="no \\*.safetensors files in .*nw"):
        read_hf_checkpoint(no_weights).tensor_shapes
    assert issubclass(HFCheckpointError, ValueError)


def test_every_family_the_reader_accepts_has_a_tensor_mapping():
    from relax.train.model import FamilyNames

    for family in FAMILIES.values():
        names = importlib.import_module(f"relax.train.model.{family.names}")
        for function in FamilyNames.__dict__:
            if not function.startswith("_"):
                assert callable(getattr(names, function)), f"{family.model_type}: {names.__name__}.{function}"


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
    checkpoint = read_hf_checkpoint(vl_dirs["qwen3_5_moe_vl"])
    fused = TensorReader(checkpoint)
    model = transformers.AutoModelForImageTextToText.from_pretrained(vl_dirs["qwen3_5_moe_vl"], dtype=torch.float32)
    experts = model.model.language_model.layers[1].mlp.experts  # transformers' own fused parameters
    for j in range(4):
        prefix = f"model.language_model.layers.1.mlp.experts.{j}."
        gate, up = experts.gate_up_proj[j].detach().chunk(2)
        assert torch.equal(fused.get(prefix + "gate_proj.weight"), gate)
        assert torch.equal(fused.get(prefix + "up_proj.weight"), up)
        assert torch.equal(fused.get(prefix + "down_proj.weight"), experts.down_proj[j].detach())
        assert checkpoint.tensor_shapes[prefix + "gate_proj.weight"] == (32, 64)
        assert checkpoint.tensor_shapes[prefix + "down_proj.weight"] == (64, 32)
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" not in checkpoint.tensor_shapes


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
