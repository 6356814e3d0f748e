"""The actor's logprobs and entropy through relax's fused Triton kernels (relax.kernels.logprobs_triton, what the
CUDA platform runs) against the torch pieces of the same function (relax.train.logprobs), on a CUDA GPU at Qwen's
vocabulary: values and gradients, bf16 and fp32 logits, temperatures, a vocabulary that is no multiple of the tile,
and a vocabulary split over two simulated tensor-parallel ranks. Skipped where there is no GPU."""

import sys
from pathlib import Path

import pytest
import torch

from relax.platform import platform_facts
from relax.train.logprobs import logprobs_and_entropy, platform_launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_vocab_parallel_logprobs import sharded_gradients  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 151936  # Qwen's padded vocabulary; 151655 tokens are real (not a multiple of any tile)
# The fused kernels' exponentials are the GPU's approximate ones: the values agree with torch's to a few float32
# rounding errors of logits around 20; a bf16 gradient may round to the neighbouring bf16 value.
VALUE_TOLERANCE = dict(atol=1e-4, rtol=1e-5)
GRADIENT_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2)}


def case(tokens: int, vocab: int, dtype: torch.dtype):
    generator = torch.Generator("cuda").manual_seed(0)
    logits = (4 * torch.randn(tokens, vocab, generator=generator, device="cuda")).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device="cuda")
    weights = torch.randn(2, tokens, generator=generator, device="cuda")
    return logits, labels, lambda logprobs, entropy: (weights[0] * logprobs).sum() + (weights[1] * entropy).sum()


def values_and_gradient(logits, labels, objective, temperature, launch):
    passed = logits.clone().requires_grad_()
    logprobs, entropy = logprobs_and_entropy(passed * 1.0, labels, temperature, launch=launch)
    objective(logprobs, entropy).backward()
    return logprobs.detach(), entropy.detach(), passed.grad


def assert_equal_results(fused, expected, dtype):
    torch.testing.assert_close(fused[0], expected[0], **VALUE_TOLERANCE)
    torch.testing.assert_close(fused[1], expected[1], **VALUE_TOLERANCE)
    torch.testing.assert_close(fused[2].float(), expected[2].float(), **GRADIENT_TOLERANCE[dtype])


def test_the_cuda_platform_runs_the_fused_kernels():
    launch = platform_launch(platform_facts("cuda"), 0)
    assert launch is not None and launch.num_programs >= torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("vocab", [VOCAB, 151655])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_equals_the_torch_pieces(dtype, temperature, vocab):
    logits, labels, objective = case(2048, vocab, dtype)
    launch = platform_launch(platform_facts("cuda"), 0)
    fused = values_and_gradient(logits, labels, objective, temperature, launch)
    expected = values_and_gradient(logits, labels, objective, temperature, None)
    assert fused[2].dtype == dtype
    assert_equal_results(fused, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_over_two_simulated_ranks_equals_one_rank(dtype):
    logits, labels, objective = case(1024, VOCAB, dtype)
    launch = platform_launch(platform_facts("cuda"), 0)
    # compiled before the ranks' threads launch them
    values_and_gradient(logits[:, : VOCAB // 2], labels % (VOCAB // 2), objective, 0.7, launch)
    (logprobs, entropy), gradient = sharded_gradients(logits, labels, 2, objective, 0.7, launch)
    expected = values_and_gradient(logits, labels, objective, 0.7, None)
    assert_equal_results((logprobs, entropy, gradient), expected, dtype)
