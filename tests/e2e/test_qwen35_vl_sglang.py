"""Tiny Qwen3.5 vision-language checkpoints, dense and MoE (laid out as the released ones: relax.tools.tiny_model
qwen3_5_vl, qwen3_5_moe_vl with fused experts) in SGLang 0.5.23's own CPU engine, driven by relax's RolloutEngine:
it generates what HF's Qwen3_5(Moe)ForConditionalGeneration generates on text-only prompts; an update exported by
relax's Megatron mapping (model.language_model.* and lm_head, experts per expert, no vision tower or MTP tensors)
passes the engine's completeness check, after which the engine generates what HF generates with the updated
weights; a tensor under its text-only name, and an update without one trained tensor, are refused.

Text-only serving on the CPU: SGLang builds Qwen3.5's multimodal processor with transformers' AutoProcessor, whose
video processors need torchvision (not in the CPU stack: the import fails), and SGLang 0.5.23's --language-model-only
refuses Qwen3_5ForConditionalGeneration (model_hook.py LANGUAGE_MODEL_ONLY_ARCHITECTURES). A checkpoint that
declares `language_model_only: true` in its config.json is served by the same Qwen3_5ForConditionalGeneration
class and loader without its vision tower and processor: the engine's copy of the checkpoint declares it.
"""

import json
import shutil

import pytest
import transformers

from relax.platform import get_platform
from relax.rollout.engine import RolloutEngine, SamplingConfig, WeightUpdateError
from relax.hf_checkpoint import read_hf_checkpoint, trained_names, transformer_config
from relax.tools.tiny_model import build_tiny_model

from hf_reference import hf_greedy
from spawned_ranks import SpawnedRanks

PROMPTS = [[5, 17], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
NEW_TOKENS = 6
LOGPROB_TOLERANCE = 1e-4


def _export(config_dir: str, weights_dir: str, out_file: str) -> None:
    """relax's Megatron model of `config_dir`'s checkpoint, loaded with `weights_dir`'s weights (standing in for
    trained ones), exported under the checkpoint's names to `out_file`."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from safetensors.torch import save_file

    from relax.train.model import build_gpt_model, export_hf_weights, load_hf_weights

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    hf = read_hf_checkpoint(config_dir)
    model = build_gpt_model(hf, transformer_config(hf, use_cpu_initialization=True, perform_initialization=False))
    load_hf_weights(model, read_hf_checkpoint(weights_dir))
    save_file({name: tensor.contiguous() for name, tensor in export_hf_weights(model, hf)}, out_file)


# The dense checkpoint's language model is test_qwen35_sglang's qwen3_5, its layout the MoE one's without experts:
# it runs in the long tier (pytest.ini), the MoE one in CI's run.
@pytest.fixture(params=[pytest.param("qwen3_5_vl", marks=pytest.mark.long), "qwen3_5_moe_vl"])
def checkpoints(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    first = build_tiny_model(root / "first", request.param, seed=0)
    second = build_tiny_model(root / "second", request.param, seed=1)
    served = root / "served"  # the engine's copy: declares text-only serving (see the module doc)
    shutil.copytree(first, served)
    config = json.loads((served / "config.json").read_text())
    (served / "config.json").write_text(json.dumps({**config, "language_model_only": True}))
    exported = root / "exported.safetensors"
    pool = SpawnedRanks(1, 300)
    try:
        pool.run(_export, str(first), str(second), str(exported))
    finally:
        pool.close()
    return {"first": first, "second": second, "served": served, "exported": exported}


def _assert_generates_like_hf(engine, model_dir, what):
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, (completion,), (ids, logprobs) in zip(PROMPTS, engine.generate(PROMPTS, greedy), hf_greedy(model_dir, PROMPTS, NEW_TOKENS, transformers.AutoModelForImageTextToText)):
        assert completion.token_ids == ids, f"{what}: greedy tokens differ for the {len(prompt)}-token prompt"
        diff = max(abs(a - b) for a, b in zip(completion.logprobs, logprobs))
        assert diff <= LOGPROB_TOLERANCE, f"{what}: logprobs of the {len(prompt)}-token prompt differ by {diff:.2e}"


def test_engine_takes_the_actors_language_model_update_and_refuses_wrong_ones(checkpoints):
    from safetensors.torch import load_file

    update = sorted(load_file(checkpoints["exported"]).items())
    names = {name for name, _ in update}
    assert names == trained_names(names) and all(n.startswith(("model.language_model.", "lm_head.")) for n in names)
    with RolloutEngine({"max_total_tokens": 2048}, model_path=str(checkpoints["served"]),
                       platform=get_platform("cpu")) as engine:
        _assert_generates_like_hf(engine, checkpoints["first"], "as loaded")

        engine.begin_weight_update()
        text_name, tensor = "model.norm.weight", dict(update)["model.language_model.norm.weight"]
        with pytest.raises(WeightUpdateError, match="tensor 'model.norm.weight' is not a tensor of the engine's"):
            engine.update_weights_from_tensor([(text_name, tensor)])
        engine.update_weights_from_tensor(update[1:])
        with pytest.raises(WeightUpdateError, match=rf"1 of {len(update)} checkpoint tensors that the actor trains"):
            engine.end_weight_update()

        engine.update_weights(update)  # complete without the vision tower and MTP tensors
        _assert_generates_like_hf(engine, checkpoints["second"], "after the actor's update")
