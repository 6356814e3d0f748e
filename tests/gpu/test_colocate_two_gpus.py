"""Colocation on two GPUs through relax's own Megatron actor (NCCL), at DP=2 and at TP=2, with one receiver process
per GPU standing in for the engine (SGLang cannot be carried to the lent machine): benchmarks/weight_sync.py's
run() on the tiny fp32 Qwen3. After training steps, each switch (engine release, wake, train, engine resume, push
over CUDA IPC, sleep) leaves the receivers with exactly the actor's weights (and HF logprobs equal to the actor's),
sleep destroys the process groups and frees at least the training state's bytes, wake rebuilds the groups with
their timeout. Timings belong to the benchmark, not here. Skipped without two CUDA GPUs or megatron-core.

Run on the lent nvidia-h200-x2 (wheels under .whl, sglang's tensor_bucket.py under .whl/sglang_tb):
    PYTHONPATH=/tmp/site:$PWD/.whl/sglang_tb:$PWD python3 -m pytest -q tests/gpu/test_colocate_two_gpus.py
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import weight_sync  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(weight_sync.write_random_qwen3(tmp_path_factory.mktemp("qwen3"), "tiny", torch.float32))


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_switch_and_ipc_push(hf_dir, tp):
    args = weight_sync.parse_args(["--device", "cuda", "--tp", str(tp), "--steps", "2", "--group-timeout-minutes", "7"])
    results = weight_sync.run(hf_dir, args)
    assert weight_sync.failed_checks(results, 7) == []
    for rank, result in enumerate(results):
        freed = [record["freed_by_sleep"] for record in result["phases"] if "freed_by_sleep" in record]
        assert len(freed) == 2 and min(freed) >= result["checks"]["state_bytes"], (rank, freed, result["checks"])
    checks = results[0]["checks"]
    assert checks["logprob_max_diff_after_push"] <= 1e-4 < checks["logprob_max_diff_initial_weights"], checks
