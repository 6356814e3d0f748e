"""Context parallelism's attention on a CUDA GPU: every CP rank's query chunks attending to their sequences' keys up to
each chunk's end (relax.platform.attention.packed_with_keys with the CUDA record's varlen flash kernel, whose causal
mask is aligned to the end of each key sequence) together give the whole row's causal attention, forward and
backward, in bf16 with grouped-query heads. The gather over the CP group is done by indexing on one GPU. Skipped
without a CUDA GPU; needs only torch:
    PYTHONPATH=$PWD python3 -m pytest -q tests/gpu/test_context_parallel_attention_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = [8, 40, 600, 1032, 16]  # multiples of 2 x CP for CP 2 and 4


@pytest.mark.parametrize("cp", [2, 4])
def test_ranks_query_chunks_give_the_whole_rows_attention_forward_and_backward(cp):
    from relax.platform import attention, platform_facts
    from relax.train.context_parallel import split_row

    kernel = platform_facts("cuda").attention_kernel
    generator = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)
    heads = torch.randn(total, 24, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    q, k, v = (part.contiguous().requires_grad_() for part in heads.split([16, 4, 4], dim=1))  # grouped-query heads
    grad_out = torch.randn(total, 16, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    cu_seqlens = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    whole = attention.packed(
        kernel, q, k, v, torch.tensor(cu_seqlens, device="cuda", dtype=torch.int32), max(LENGTHS), 128**-0.5
    )
    splits = [split_row(cu_seqlens, cp, rank, None, "cuda") for rank in range(cp)]
    gathered_rows = torch.cat([split.token_index for split in splits])  # the all-gather, in rank order
    split_out = torch.empty_like(whole)
    for split in splits:
        split_out[split.token_index] = attention.packed_with_keys(
            kernel, q[split.token_index], k[gathered_rows][split.key_index], v[gathered_rows][split.key_index],
            split.query_cu_seqlens, split.key_cu_seqlens, split.max_query_len, split.max_key_len, 128**-0.5,
        )
    torch.testing.assert_close(split_out, whole, atol=2e-2, rtol=2e-2)
    for got, expected in zip(torch.autograd.grad(split_out, (q, k, v), grad_out),
                             torch.autograd.grad(whole, (q, k, v), grad_out)):
        torch.testing.assert_close(got, expected, atol=5e-2, rtol=5e-2)
