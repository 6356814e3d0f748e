"""relax's kernels for sgl-kernel-npu (relax.kernels.sgl_kernel_npu) compiled by Triton for a CUDA GPU, against
their torch references: the checks of tests/unit/test_kernels_sgl_kernel_npu.py (there under Triton's
interpreter), here on the GPU, at their own small shapes and at the per-rank shapes of the Qwen3.5 NPU presets
(scripts/run-qwen35-9B-8xnpu-colocate.sh: engines of TP 2; scripts/run-qwen35-35B-A3B-16xnpu-colocate.sh: TP 8).
The grid is one program per SM, as on an NPU it is one per vector core. Skipped where there is no GPU."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import test_kernels_sgl_kernel_npu as checks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("rows,cols_and_dtypes", [
    pytest.param(5, checks.SIGMOID_MUL_COLS_AND_DTYPES, id="unit-shapes"),
    # 2048: 9B's attention output gate per rank (16 heads x 256 / TP 2) and 35B-A3B's shared expert (hidden 2048,
    # one gate per row); 512: 35B-A3B's attention output gate per rank (16 x 256 / TP 8). A 64-request decode batch.
    pytest.param(64, ((2048, torch.bfloat16), (512, torch.bfloat16)), id="qwen35-per-rank-bf16"),
])
def test_sigmoid_mul(rows, cols_and_dtypes):
    checks.check_sigmoid_mul("cuda", rows, cols_and_dtypes, num_programs=sms())


@pytest.mark.parametrize("heads_and_dims,block_vs,dtype,tol", [
    pytest.param((2, 4, 16, 12), (8, 32), torch.float32, 1e-5, id="unit-shapes-f32"),
    # key heads, value heads, key dim, value dim per rank: 9B at TP 2, 35B-A3B at TP 8 (16 key and 32 value heads
    # of 128 in both models). bf16 inputs and state pool, as the presets run (--sglang-mamba-ssm-dtype bfloat16);
    # float32 as a tight check of the same shapes (K = 128 sums: a little looser than the small case).
    pytest.param((8, 16, 128, 128), (16, 32), torch.bfloat16, 2e-2, id="9B-tp2-bf16"),
    pytest.param((2, 4, 128, 128), (16, 32), torch.bfloat16, 2e-2, id="35B-A3B-tp8-bf16"),
    pytest.param((8, 16, 128, 128), (32,), torch.float32, 2e-5, id="9B-tp2-f32"),
])
def test_gdn_decode(heads_and_dims, block_vs, dtype, tol):
    checks.check_gdn_decode("cuda", heads_and_dims, block_vs, num_programs=sms(), dtype=dtype, state_dtype=dtype,
                            tol=tol)


@pytest.mark.parametrize("rows,experts_and_top_k", [
    pytest.param(7, checks.MOE_EXPERTS_AND_TOP_K, id="unit-shapes"),
    # 35B-A3B's routing (256 experts, top 8) over a 128-request decode batch
    pytest.param(128, ((256, 8),), id="35B-A3B"),
])
def test_moe_routing(rows, experts_and_top_k):
    checks.check_moe_routing("cuda", rows, experts_and_top_k, num_programs=sms())
