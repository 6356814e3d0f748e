"""Context parallelism's Gated DeltaNet layers on a CUDA GPU: each CP rank's chunks, started from the state [0 | I] on
values K columns wider and corrected by the states before them (relax.train.context_parallel.RecurrenceSplit),
give the whole rows' convolution and gated delta rule, at Qwen3.5's head sizes (K = V = 128), on sequences of
different lengths (one-token chunks among them). With relax's torch reference and relax's kernel
(relax.kernels.gdn_chunk_triton): forward and every input's gradient.
With flash-linear-attention's chunk_gated_delta_rule (what the actor uses on GPU where it runs): the forward; fla
0.6.0's backward needs Triton >= 3.7.1 on Hopper. The all-gathers are done by concatenating on one GPU. Skipped
without a CUDA GPU (and the fla case without fla):
    source tests/gpu/bundle/enter.sh && python3 -m pytest -q tests/gpu/test_context_parallel_gdn_gpu.py
"""

import functools
import importlib.util

import pytest
import torch

from helpers import gdn_rows_split_over_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = [8, 40, 600, 1032, 16]  # multiples of 2 x CP for CP 2 and 4 (8 tokens at CP=4: one-token chunks)


@pytest.mark.parametrize("kernel", ["reference", "relax"])
@pytest.mark.parametrize("cp", [2, 4])
def test_rule_split_over_ranks_gives_the_whole_rows_forward_and_backward(cp, kernel):
    from relax.kernels.gdn_training import gdn_training_kernel
    from relax.platform import get_platform

    chunk_gated_delta_rule, _ = gdn_training_kernel(kernel)
    if kernel == "relax":
        chunk_gated_delta_rule = functools.partial(chunk_gated_delta_rule, launch=get_platform("cuda").triton_launch(0))
    compared = gdn_rows_split_over_ranks(cp, LENGTHS, chunk_gated_delta_rule, "cuda", heads=4, key_dim=128,
                                         value_dim=128)
    for name, split, whole in compared:
        torch.testing.assert_close(split, whole, atol=2e-4, rtol=2e-4, msg=name)


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention")
@pytest.mark.parametrize("cp", [2, 4])
def test_fla_rule_split_over_ranks_gives_the_whole_rows_forward(cp):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    compared = gdn_rows_split_over_ranks(cp, LENGTHS, chunk_gated_delta_rule, "cuda", heads=4, key_dim=128,
                                         value_dim=128, backward=False)
    # fla multiplies float32 in TF32 (tests/gpu/test_qwen35_actor_gpu.py's bound)
    for name, split, whole in compared:
        torch.testing.assert_close(split, whole, atol=2e-3, rtol=2e-3, msg=name)
