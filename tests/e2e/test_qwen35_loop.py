"""The tiny colocated run on a hybrid Gated DeltaNet model: scripts/run-tiny-cpu.sh --tiny-model qwen3_5 for a few
steps through the real stack (local Ray, SGLang engine actor serving the GDN layers with relax's torch operators,
Megatron actor on megatron-core's GatedDeltaNet).

Every weight push is checked by the engine itself (relax.rollout.engine refuses unknown names, wrong shapes and
a push that misses any checkpoint tensor), so a run that completes pushed every Qwen3.5 tensor under its HF name
(in_proj_qkv/z/b/a, conv1d, A_log, dt_bias, the gated norm, gated full attention) after every step. The reward
is not asserted: it needs dozens of steps to rise (docs/benchmarks.md, "Tiny Qwen3.5 colocated run on CPU").
"""

import json
import os
import subprocess
from pathlib import Path

from processes import describe, leftover_processes, run_marker
from test_loop import PERF_KEYS

ROOT = Path(__file__).resolve().parents[2]
NUM_STEPS = 3


def test_tiny_qwen35_colocated_run_logs_every_phase_and_every_push_is_accepted(tmp_path):
    marker = run_marker()
    env = {**os.environ, **marker, "EXP_DIR": str(tmp_path), "RELAX_PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run-tiny-cpu.sh"), "--tiny-model", "qwen3_5", "--num-steps", str(NUM_STEPS)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and "linear_attention" in config["layer_types"]

    records = [json.loads(line) for line in (tmp_path / "output" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(NUM_STEPS))
    for record in records:
        for key in (*PERF_KEYS, "rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/grad_norm"):
            assert key in record, f"step {record['step']} lacks {key}"
        assert record["perf/weight_sync_time"] > 0.0
        assert 0.0 <= record["rollout/reward_mean"] <= 1.0
        assert record["train/update_successful"] == 1.0
        assert record["train/grad_norm"] > 0.0  # gradients reached the policy (GDN layers included)
    leftover = leftover_processes(marker)
    assert not leftover, f"processes left behind by the run: {describe(leftover)}"
