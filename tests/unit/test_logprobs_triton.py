"""relax.kernels.logprobs_triton, the fused logprob and entropy kernels, through relax.train.logprobs'
logprobs_and_entropy with a launch record, against the same function's torch pieces (no launch record) and torch's
log_softmax over the whole vocabulary, on CPU via TRITON_INTERPRET=1 (each check in its own interpreter subprocess,
as tests/unit/test_kernels_triton.py explains): values and gradients, float32 and bfloat16 logits, temperatures, a
vocabulary that is no multiple of the tile, and a vocabulary split over two simulated tensor-parallel ranks."""

import threading

import pytest
import torch

from test_kernels_triton import run_interpreted


def _kernels_one_at_a_time() -> None:
    """Triton's interpreter runs a kernel by patching triton.language for the call: one kernel at a time among the
    simulated ranks' threads."""
    from relax.kernels import logprobs_triton

    interpreter = threading.Lock()
    for name in ("row_stats", "write_gradient"):
        def one_at_a_time(*args, kernel=getattr(logprobs_triton, name)):
            with interpreter:
                return kernel(*args)
        setattr(logprobs_triton, name, one_at_a_time)


def check_fused_matches_torch(ranks: int, dtype_name: str):
    from relax.kernels.launch import TritonLaunch
    from test_vocab_parallel_logprobs import entropy_only, logprobs_only, sharded_gradients, weighted, whole_vocabulary

    _kernels_one_at_a_time()

    dtype = getattr(torch, dtype_name)
    # 3 programs over 9 positions: each program loops over positions. A vocabulary of 37 per rank in tiles of 8:
    # four whole tiles and a tail of 5.
    launch = TritonLaunch(num_programs=3, logprob_block_vocab=8)
    generator = torch.Generator().manual_seed(0)
    vocab = 37 * ranks
    logits = (3 * torch.randn(1, 9, vocab, generator=generator)).to(dtype)
    labels = torch.tensor([[0, 5, vocab - 1, 36, 37 % vocab, 4, 4, vocab - 2, 19]])
    for temperature in (1.0, 0.7):
        for objective in (weighted(generator, (1, 9)), logprobs_only, entropy_only):
            (logprobs, entropy), grad = sharded_gradients(logits, labels, ranks, objective, temperature, launch)
            (torch_logprobs, torch_entropy), torch_grad = sharded_gradients(logits, labels, ranks, objective,
                                                                            temperature)
            # a copy: whole_vocabulary's float32 logits would be these logits themselves, left requiring a gradient
            (expected_logprobs, expected_entropy), expected_grad = whole_vocabulary(logits.clone(), labels, objective,
                                                                                    temperature)
            assert logprobs.dtype == entropy.dtype == torch.float32 and grad.dtype == dtype
            torch.testing.assert_close(logprobs, torch_logprobs)
            torch.testing.assert_close(entropy, torch_entropy)
            torch.testing.assert_close(grad, torch_grad)
            torch.testing.assert_close(logprobs, expected_logprobs)
            torch.testing.assert_close(entropy, expected_entropy)
            torch.testing.assert_close(grad, expected_grad.to(dtype))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_fused_values_and_gradients_equal_the_torch_pieces_interpreted(ranks, dtype_name):
    run_interpreted("check_fused_matches_torch", ranks, dtype_name, module=__name__)


def check_output_projection_matches_torch(ranks: int):
    from relax.kernels.launch import TritonLaunch
    from relax.train import logprobs
    from test_vocab_parallel_logprobs import fused_gradients, weighted

    _kernels_one_at_a_time()

    # The logits in pieces of 3 positions forward (of a rank's 37 columns) and of 12 columns backward (of 9 positions),
    # each streamed by the kernels in tiles of 8
    logprobs.CHUNK_BYTES = 4 * 37 * 3
    launch = TritonLaunch(num_programs=3, logprob_block_vocab=8)
    generator = torch.Generator().manual_seed(0)
    vocab = 37 * ranks
    hidden, weight = torch.randn(9, 6, generator=generator), torch.randn(vocab, 6, generator=generator)
    labels = torch.tensor([0, 5, vocab - 1, 36, 37 % vocab, 4, 4, vocab - 2, 19])
    objective = weighted(generator, (9,))
    fused = fused_gradients(hidden, weight, labels, ranks, objective, 0.7, launch)
    expected = fused_gradients(hidden, weight, labels, ranks, objective, 0.7)
    for got, want in zip([*fused[0], *fused[1:]], [*expected[0], *expected[1:]]):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_fused_output_projection_through_the_kernels_equals_its_torch_pieces_interpreted(ranks):
    run_interpreted("check_output_projection_matches_torch", ranks, module=__name__)


def check_large_logits_and_many_tiles():
    """Logits far from 0 (a maximum that grows tile after tile, the sums rescaled each time) over many tiles; a
    forward without a backward leaves the logits as they were."""
    from relax.kernels.launch import TritonLaunch
    from relax.train.logprobs import logprobs_and_entropy

    launch = TritonLaunch(num_programs=2, logprob_block_vocab=4)
    logits = 40.0 * torch.arange(30.0).repeat(5, 1) / 30.0 + 100.0  # each tile's maximum above the last
    logits[1] = logits[1].flip(0)  # the maximum in the first tile
    labels = torch.tensor([0, 29, 13, 7, 28])
    given = logits.clone()
    with torch.no_grad():
        fused = logprobs_and_entropy(logits, labels, 0.5, launch=launch)
    assert torch.equal(logits, given)
    expected = logprobs_and_entropy(logits, labels, 0.5)
    torch.testing.assert_close(fused, expected)


def test_fused_kernels_rescale_a_growing_maximum_interpreted():
    run_interpreted("check_large_logits_and_many_tiles", module=__name__)


def test_each_platform_names_a_logprob_kernel_and_only_cuda_the_fused_one():
    from relax.platform import PLATFORMS, platform_facts
    from relax.train.logprobs import LOGPROB_KERNELS, platform_launch

    assert {platform.logprob_kernel for platform in PLATFORMS.values()} <= set(LOGPROB_KERNELS)
    assert platform_facts("cuda").logprob_kernel == "triton"
    for name in ("cpu", "npu"):  # torch's pieces: no Triton launch asked for (nor the device's core count)
        assert platform_launch(platform_facts(name), 0) is None


def test_an_unknown_logprob_kernel_is_refused():
    from types import SimpleNamespace

    from relax.train.logprobs import platform_launch

    with pytest.raises(ValueError, match="unknown logprob kernel 'fast'.*choose one of torch, triton"):
        platform_launch(SimpleNamespace(logprob_kernel="fast"), 0)
