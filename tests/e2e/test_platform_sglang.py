"""SGLang 0.5.23's own Engine runs on the CPU platform: greedy tokens equal HF transformers' greedy ones,
and shutdown leaves no SGLang process behind.

The engine runs in a fresh interpreter: the CPU platform must be prepared before sglang is first imported
(SGLang caches its device at import), and other tests in the same session may already have imported it.
"""

import json
import subprocess
import sys
import textwrap


from relax.tiny_model import build_tiny_model

from hf_reference import hf_greedy

PROMPTS = [[5, 17, 30, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48], [12]]
NEW_TOKENS = 12

ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import psutil
    from relax.platform import get_platform

    model_dir, prompts, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    platform = get_platform("cpu")
    platform.prepare_sglang()
    import sglang

    def alive_children():
        return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}

    engine = sglang.Engine(model_path=model_dir, log_level="error", **platform.sglang_server_defaults)
    started = alive_children()
    try:
        results = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True},
        )
    finally:
        engine.shutdown()
    print(json.dumps({
        "output_ids": [r["output_ids"] for r in results],
        "started": sorted(started),
        "alive_after_shutdown": sorted(alive_children() & started),
    }))
    """
)


def test_engine_greedy_equals_hf_and_shutdown_leaves_no_process(tmp_path):
    model_dir = build_tiny_model(tmp_path / "qwen3", family="qwen3")
    run = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT, str(model_dir), json.dumps(PROMPTS), str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-5000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["output_ids"] == [ids for ids, _ in hf_greedy(model_dir, PROMPTS, NEW_TOKENS)]
    assert result["started"], "the engine should run its scheduler in child processes"
    assert result["alive_after_shutdown"] == [], "SGLang processes left running after shutdown"
