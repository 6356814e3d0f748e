"""Qwen3.5 (hybrid GDN + full attention) through relax's Megatron actor on a CUDA GPU: with relax's kernel
(relax.kernels.gdn_chunk_triton, the CUDA default) in megatron-core's GatedDeltaNet the actor's logprobs equal HF
transformers' within 1e-4 in float32, as on the CPU; with flash-linear-attention's within 2e-3 (fla's Triton
kernels multiply float32 in TF32). A few train steps in bf16 with relax's kernel lower the trained tokens' negative
log-likelihood (fla 0.6.0 refuses its own backward on Hopper with Triton < 3.7.1). Skipped without a CUDA GPU or
megatron-core, the fla case without fla.

Run on the lent H200 (wheels under .whl):
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q tests/gpu/test_qwen35_actor_gpu.py
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import qwen35_train  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    platform = qwen35_train.init_distributed("cuda")
    yield platform, qwen35_train.write_checkpoint(tmp_path_factory.mktemp("qwen35"), "small")
    torch.distributed.destroy_process_group()


def test_logprobs_equal_hf_with_relax_kernel(setup):
    platform, hf_dir = setup
    parity = qwen35_train.logprob_parity(hf_dir, platform, gdn_kernel="relax")
    assert parity["max_abs_diff"] <= 1e-4, parity


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention")
def test_logprobs_equal_hf_with_fla_kernels(setup):
    platform, hf_dir = setup
    parity = qwen35_train.logprob_parity(hf_dir, platform, gdn_kernel="fla")
    assert parity["max_abs_diff"] <= 2e-3, parity


def test_training_lowers_the_loss(setup):
    """With relax's kernel: fla 0.6.0 refuses its backward on Hopper with Triton < 3.7.1 (fla#640)."""
    platform, hf_dir = setup
    result = qwen35_train.train(
        hf_dir, platform, steps=5, samples=8, seq=256, micro_batch_size=4, lr=1e-3, gdn_kernel="relax"
    )
    nll = result["nll_before_each_step"]
    assert nll[-1] < 0.8 * nll[0], nll
