"""relax.platform.grouped_linear: each platform's grouped product equals one matrix product per group, forward and
gradients, with uneven and empty groups. The CUDA kernel's call (torch._grouped_mm) runs here where this torch has
a CPU implementation of it; the NPU one runs against tests/npu's CPU stand-in for torch_npu.npu_grouped_matmul, bound by the op's schemas from
the torch-npu wheel (no NPU here), so what is tested is relax's plumbing: argument modes, layouts, gradients."""

import sys
import types

import pytest
import torch

from relax.platform import grouped_linear, platform_facts
from tests.npu import torch_npu_ops

TOKENS_PER_GROUP = [[3, 0, 5, 1], [0, 0, 0, 0], [0, 4, 0, 0]]


def operands(tokens_per_group, inputs=16, outputs=8):
    generator = torch.Generator().manual_seed(sum(tokens_per_group))
    counts = torch.tensor(tokens_per_group)
    x = torch.randn(int(counts.sum()), inputs, generator=generator)
    weights = torch.randn(len(tokens_per_group), outputs, inputs, generator=generator)
    grad = torch.randn(int(counts.sum()), outputs, generator=generator)
    return x, weights, counts, grad


def per_group_reference(x, weights, counts, grad):
    """Output and gradients of one torch.nn.functional.linear per group."""
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    starts = [0, *torch.cumsum(counts, 0).tolist()]
    output = torch.cat(
        [torch.nn.functional.linear(x[a:b], weight) for a, b, weight in zip(starts, starts[1:], weights)]
    )
    output.backward(grad)
    return output.detach(), x.grad, weights.grad


def run(function, x, weights, counts, grad):
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    output = function(x, weights, counts)
    output.backward(grad)
    return output.detach(), x.grad, weights.grad


@pytest.mark.parametrize("tokens_per_group", TOKENS_PER_GROUP)
def test_cpu_record_loops_over_groups(tokens_per_group):
    case = operands(tokens_per_group)
    for got, expected in zip(run(platform_facts("cpu").grouped_linear, *case), per_group_reference(*case)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("tokens_per_group", TOKENS_PER_GROUP)
def test_cuda_kernel_call_computes_the_grouped_product(tokens_per_group):
    """grouped_mm_linear's offsets and transposed weights, run through torch's own CPU _grouped_mm."""
    case = operands(tokens_per_group)
    try:
        got = run(grouped_linear.grouped_mm_linear, *case)
    except (NotImplementedError, RuntimeError) as error:
        pytest.skip(f"torch._grouped_mm does not run on this CPU build: {error}")
    for got_tensor, expected in zip(got, per_group_reference(*case)):
        torch.testing.assert_close(got_tensor, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capability, applies", [((9, 0), True), ((10, 0), True), ((8, 0), False), ((12, 0), False)])
def test_grouped_mm_applies_to_aligned_bf16_on_hopper_and_blackwell(capability, applies, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)  # no GPU here
    x, weights = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(2, 8, 16, dtype=torch.bfloat16)
    assert grouped_linear.grouped_mm_applies(x, weights) == applies
    assert not grouped_linear.grouped_mm_applies(x.float(), weights.float())
    unaligned = torch.randn(4, 12, dtype=torch.bfloat16), torch.randn(2, 8, 12, dtype=torch.bfloat16)
    assert not grouped_linear.grouped_mm_applies(*unaligned)  # rows of 24 bytes: not 16-byte aligned


@pytest.mark.parametrize("tokens_per_group", TOKENS_PER_GROUP)
def test_npu_record_calls_the_grouped_matmul_for_forward_and_both_gradients(tokens_per_group, monkeypatch):
    calls = []
    torch_npu_stand_in = types.ModuleType("torch_npu")
    torch_npu_ops.install(torch_npu_stand_in)

    def recording(*args, **kwargs):
        calls.append(kwargs["group_type"])
        return torch_npu_stand_in.npu_grouped_matmul(*args, **kwargs)

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_grouped_matmul=recording))
    case = operands(tokens_per_group)
    for got, expected in zip(run(platform_facts("npu").grouped_linear, *case), per_group_reference(*case)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert calls == [0, 0, 2]  # forward, input gradient, weight gradient: one call each
