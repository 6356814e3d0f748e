"""benchmarks/weight_sync.py's run() on the CPU (gloo, two training ranks, one receiver process each), so that
the code tests/gpu/test_colocate_two_gpus.py runs on two GPUs is exercised in CI too: relax's Megatron actor
trains, sleeps (its process groups destroyed) and wakes (rebuilt with their timeout), and its pushes leave each
receiver with exactly the actor's weights. Only the receivers' release and resume stay GPU-only: on the CPU they
do nothing, as SGLang's do. Timings belong to the benchmark, not here.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import weight_sync  # noqa: E402

pytestmark = pytest.mark.long  # pytest.ini: not in CI's run


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_switch_and_push_on_cpu(tmp_path, tp):
    hf_dir = str(weight_sync.write_random_qwen3(tmp_path / "qwen3", "tiny", torch.float32))
    args = weight_sync.parse_args(["--device", "cpu", "--tp", str(tp), "--steps", "2", "--group-timeout-minutes", "7",
                                   "--work-dir", str(tmp_path / "work")])
    results = weight_sync.run(hf_dir, args)
    assert len(results) == 2
    assert weight_sync.failed_checks(results, 7) == []
    checks = results[0]["checks"]
    assert checks["logprob_max_diff_after_push"] <= 1e-4 < checks["logprob_max_diff_initial_weights"], checks
