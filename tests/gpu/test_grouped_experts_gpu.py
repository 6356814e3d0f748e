"""--moe-grouped-gemm on a CUDA GPU: the CUDA record's grouped product (torch._grouped_mm in bf16 on Hopper) against
one matrix product per group, forward and gradients, with uneven and empty groups and a Qwen3-30B-A3B expert's
shape. Skipped where there is no GPU."""

import pytest
import torch

from relax.platform import grouped_linear, platform_facts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, FFN = 2048, 768  # Qwen3-30B-A3B's hidden size and expert ffn


@pytest.mark.parametrize("tokens_per_group", [[300, 0, 17, 1, 0, 955, 64, 3], [0] * 8, [1, 2, 3, 4, 5, 6, 7, 8]])
@pytest.mark.parametrize("outputs, inputs", [(2 * FFN, HIDDEN), (HIDDEN, FFN)])
def test_grouped_mm_equals_one_product_per_group(tokens_per_group, outputs, inputs):
    generator = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor(tokens_per_group)
    x = torch.randn(int(counts.sum()), inputs, generator=generator, device="cuda", dtype=torch.bfloat16)
    weights = torch.randn(len(counts), outputs, inputs, generator=generator, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(int(counts.sum()), outputs, generator=generator, device="cuda", dtype=torch.bfloat16)
    if torch.cuda.get_device_capability()[0] == 9:  # the H200 the GPU tests run on: the kernel must be chosen
        assert grouped_linear.grouped_mm_applies(x, weights)
    results = []
    for function in (platform_facts("cuda").grouped_linear, grouped_linear.looped_grouped_linear):
        leaves = x.clone().requires_grad_(), weights.clone().requires_grad_()
        output = function(*leaves, counts)
        output.backward(grad)
        results.append([output.float(), leaves[0].grad.float(), leaves[1].grad.float()])
    for got, expected in zip(*results):
        assert got.shape == expected.shape
        if expected.numel():  # no tokens at all: the input and its gradient are empty
            scale = expected.abs().max().clamp(min=1.0)
            assert ((got - expected).abs().max() / scale).item() <= 2e-2
