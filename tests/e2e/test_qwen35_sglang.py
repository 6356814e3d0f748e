"""Tiny Qwen3.5 (dense, MoE) and Qwen3-Next generate through SGLang 0.5.23's own CPU engine with relax's torch
operators serving the sgl_kernel CPU ops (relax/platform/cpu_sgl_kernel_registry.py): greedy tokens equal HF
transformers', logprobs agree within 1e-4 (float32), prompts of 2, 9 and 131 tokens (the last runs the chunked
prefill over several 64-token chunks).

After the first generation the engine receives, by update_weights_from_tensor, every weight of a second random
checkpoint of the same shapes, and must then generate exactly what HF generates with that checkpoint: weights
SGLang keeps in a second form (the GDN conv weight is also cached as a [conv_dim, W] view) would show up here.
SGLang's own shutdown then leaves none of the engine's processes running.

One engine start per model the session tests, one after another in one fresh interpreter (SGLANG_FAMILIES; CI's run
leaves Qwen3-Next to the long tier): the CPU platform must be prepared before sglang is first imported (SGLang fixes
its device at import), and other tests of the session have imported it already; one interpreter for all imports
SGLang once (about 8 CPU-seconds each), and the engines' processes are forked from one server (the platform's
sglang_engine_processes, as in a run), held for all, which imports SGLang's scheduler once.
"""

import json
import subprocess
import sys
import textwrap

import pytest

from relax.tools.tiny_model import build_tiny_model

from hf_reference import hf_greedy

PROMPTS = [[5, 17], [40, 41, 42, 43, 44, 45, 46, 47, 48], [3 + (7 * i) % 50 for i in range(131)]]
NEW_TOKENS = 6
LOGPROB_TOLERANCE = 1e-4

ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import psutil
    from relax.platform import get_platform

    models, prompts, new_tokens = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    platform = get_platform("cpu")
    platform.prepare_sglang()
    import sglang
    from safetensors.torch import load_file

    def generate(engine):
        results = engine.generate(
            input_ids=prompts, return_logprob=True,
            sampling_params={"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True},
        )
        return [
            {"ids": r["output_ids"], "logprobs": [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]}
            for r in results
        ]

    def alive_children():  # the engine's scheduler and detokenizer (not the server they are forked from)
        return {p.pid for p in psutil.Process().children(recursive=True)
                if p.name().startswith("sglang::") and p.status() != psutil.STATUS_ZOMBIE}

    def run(model_dir, updated_dir):
        engine = sglang.Engine(model_path=model_dir, log_level="error", **platform.sglang_server_defaults)
        started = alive_children()
        try:
            before = generate(engine)
            new_weights = sorted(load_file(f"{updated_dir}/model.safetensors").items())
            # SGLang 0.5.23 takes weight updates only inside a begin/end session
            for call, args in ((engine.begin_weight_update, ()), (engine.update_weights_from_tensor, (new_weights,)),
                               (engine.end_weight_update, ())):
                result = call(*args)
                ok, message = (result.success, result.message) if hasattr(result, "success") else result
                assert ok, f"{call.__name__}: {message}"
            after = generate(engine)
        finally:
            engine.shutdown()
        return {"before": before, "after": after, "started": sorted(started),
                "alive_after_shutdown": sorted(alive_children() & started)}

    with platform.sglang_engine_processes():
        print(json.dumps({family: run(*dirs) for family, dirs in models.items()}))
    """
)


def _hf_greedy(model_dir):
    return [{"ids": ids, "logprobs": logprobs} for ids, logprobs in hf_greedy(model_dir, PROMPTS, NEW_TOKENS)]


def _assert_same_generation(engine_out, hf_out, what):
    for prompt, got, want in zip(PROMPTS, engine_out, hf_out):
        assert got["ids"] == want["ids"], f"{what}: greedy tokens differ for the {len(prompt)}-token prompt"
        assert len(got["logprobs"]) == len(want["logprobs"]) == NEW_TOKENS, f"{what}: logprobs missing"
        diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))
        assert diff <= LOGPROB_TOLERANCE, f"{what}: logprobs of the {len(prompt)}-token prompt differ by {diff:.2e}"


# Qwen3-Next shares Qwen3.5's GDN serving path: its engine runs in the long tier (pytest.ini), not in CI's run.
SGLANG_FAMILIES = ("qwen3_5", "qwen3_5_moe", pytest.param("qwen3_next", marks=pytest.mark.long))


def _selected_families(session, module) -> list[str]:
    """The families of this module's tests that the session runs (after -m, -k and node ids deselected others)."""
    return [item.callspec.params["family"] for item in session.items if item.module is module]


@pytest.fixture(scope="module")
def engine_runs(request, tmp_path_factory) -> dict:
    """Per family the session runs: its tiny model and a second random checkpoint of the same shapes, and what
    ENGINE_SCRIPT's engine generated with each (one interpreter, the engines one after another)."""
    # SGLang 0.5.23 reads the layer kinds from full_attention_interval (configs/qwen3_next.py
    # layers_block_type), HF from layer_types: the tiny models' layer_types are every 4th layer full attention.
    families = _selected_families(request.session, request.module)
    models = {}
    for family in families:
        root = tmp_path_factory.mktemp(family)
        models[family] = [str(build_tiny_model(root / name, family=family, seed=seed, full_attention_interval=4))
                          for name, seed in (("first", 0), ("second", 1))]
    run = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT, json.dumps(models), json.dumps(PROMPTS), str(NEW_TOKENS)],
        capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-6000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    return {family: (*models[family], results[family]) for family in families}


@pytest.mark.parametrize("family", SGLANG_FAMILIES)
def test_engine_generates_like_hf_before_and_after_a_full_weight_update_and_stops_cleanly(engine_runs, family):
    model_dir, updated_dir, result = engine_runs[family]
    _assert_same_generation(result["before"], _hf_greedy(model_dir), f"{family} as loaded")
    _assert_same_generation(result["after"], _hf_greedy(updated_dir), f"{family} after update_weights_from_tensor")
    assert result["started"], "the engine should run its scheduler in child processes"
    assert result["alive_after_shutdown"] == [], "SGLang processes left running after shutdown"
