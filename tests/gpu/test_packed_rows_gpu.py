"""Packed THD rows on a CUDA GPU: the CUDA record's attention kernel (torch's varlen flash attention) against
scaled_dot_product_attention one sequence at a time, forward and backward, in bf16 with grouped-query heads; and the
actor's logprobs with many samples packed into one micro-batch against one sample per micro-batch, for Qwen3 and for
Qwen3.5 (whose GDN layers then run relax's chunk kernel, relax.kernels.gdn_chunk_triton, with cu_seqlens). Skipped
without a CUDA GPU or megatron-core.

Run on the lent H200 (wheels under .whl):
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q tests/gpu/test_packed_rows_gpu.py
"""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import qwen35_train  # noqa: E402

LENGTHS = [1, 17, 300, 1024, 5, 513]


def _per_sequence_sdpa(q, k, v, cu_seqlens, scale):
    bounds = cu_seqlens.tolist()
    return torch.cat([
        F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True,
        )[0].transpose(0, 1)
        for s, e in zip(bounds, bounds[1:])
    ])


def test_varlen_flash_equals_sdpa_per_sequence_forward_and_backward():
    from relax.platform import attention, platform_facts

    kernel = platform_facts("cuda").attention_kernel
    generator = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)
    q, k, v = (
        torch.randn(total, heads, 128, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
        for heads in (16, 4, 4)
    )
    cu_seqlens = torch.tensor([0] + LENGTHS, device="cuda").cumsum(0).to(torch.int32)
    grad_out = torch.randn(total, 16, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    results = []
    for compute in (
        lambda: attention.packed(kernel, q, k, v, cu_seqlens, max(LENGTHS), 128**-0.5),
        lambda: _per_sequence_sdpa(q, k, v, cu_seqlens, 128**-0.5),
    ):
        out = compute()
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        results.append((out.float(), [g.float() for g in grads]))
    (flash, flash_grads), (sdpa, sdpa_grads) = results
    torch.testing.assert_close(flash, sdpa, atol=2e-2, rtol=2e-2)
    for a, b in zip(flash_grads, sdpa_grads):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


@pytest.fixture(scope="module")
def platform():
    platform = qwen35_train.init_distributed("cuda")
    yield platform
    torch.distributed.destroy_process_group()


def _packed_against_one_per_micro_batch(hf_dir, platform) -> float:
    from relax.train.batch import RolloutBatch

    actor = qwen35_train.make_actor(hf_dir, platform, torch.bfloat16, lr=1e-4, micro_batch_size=1, gdn_kernel="relax")
    generator = torch.Generator().manual_seed(4)
    vocab = actor.hf_checkpoint.text_config["vocab_size"]
    lengths = [(n, max(1, n // 3)) for n in (200, 37, 130, 2, 96, 64)]
    batch = RolloutBatch([torch.randint(0, vocab, (n,), generator=generator) for n, _ in lengths], [r for _, r in lengths])
    alone = actor.compute_logprobs(batch)
    actor.settings = dataclasses.replace(actor.settings, max_tokens_per_micro_batch=sum(batch.token_counts()))
    packed = actor.compute_logprobs(batch)
    return max((a - b).abs().max().item() for a, b in zip(alone, packed))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_packed_logprobs_equal_one_sample_per_micro_batch(platform, family, tmp_path):
    from relax.tools.tiny_model import build_tiny_model

    if family == "qwen3_5":
        hf_dir = qwen35_train.write_checkpoint(tmp_path, "small")
    else:
        hf_dir = str(build_tiny_model(tmp_path / "qwen3", "qwen3", head_dim=64))
    # bf16 activations round differently in differently shaped matmuls (a few bf16 ulps of logits near 8, 0.03 each);
    # a sequence seeing another's tokens or state moves logprobs by O(1)
    assert _packed_against_one_per_micro_batch(hf_dir, platform) <= 0.1
