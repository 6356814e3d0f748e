import json

import pytest
import torch
import transformers

from relax.tools.tiny_model import FAMILIES, build_tiny_model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_model_loads_in_transformers_with_a_lossless_tokenizer(tmp_path, family):
    build_tiny_model(tmp_path, family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)

    text = "12+7=19, ok?\nyes!"
    ids = tokenizer(text).input_ids
    assert len(ids) == len(text), "one token per character"
    assert tokenizer.decode(ids) == text
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tokenizer.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer)) and torch.isfinite(logits).all()
    assert json.loads((tmp_path / "relax_tiny_model.json").read_text())["family"] == family


def test_unknown_family_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="qwen3_moe"):
        build_tiny_model(tmp_path, "llama")


def test_the_tool_chat_tokenizer_writes_tool_calls_and_keeps_its_tool_tokens(tmp_path):
    build_tiny_model(tmp_path, "qwen3", tool_chat=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = '<think>\nAdd.</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"x": "[1_2]"}}\n</tool_call>'
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text  # the tool tokens are not special: kept
    for token in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert len(tokenizer(token).input_ids) == 1
    assert len(tokenizer("\n\n").input_ids) == 1  # the one merge
