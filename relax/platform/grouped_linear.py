"""Grouped linear products: consecutive groups of rows, each group times its own weight matrix. MoE experts run one
such product per projection over the tokens sorted by expert (relax.train.model.grouped_experts).

    grouped_linear(inputs [tokens, in], weights [groups, out, in], tokens_per_group [groups]) -> [tokens, out]

Rows tokens_per_group[0] first go through weights[0] (as torch.nn.functional.linear, no bias), the next
tokens_per_group[1] through weights[1], and so on; a group may be empty. Every implementation is differentiable in
inputs and weights. Each platform record names its own (Platform.grouped_linear):

- looped_grouped_linear: one matrix product per group (the CPU's, and CUDA's where no grouped kernel applies).
- cuda_grouped_linear: torch._grouped_mm, one CUTLASS kernel for all groups, for bf16 on Hopper and Blackwell
  data-centre GPUs (compute capability 9.x, 10.x) with 16-byte aligned rows; otherwise the loop.
- npu_grouped_linear: torch_npu.npu_grouped_matmul, Ascend's grouped matmul (the op MindSpeed's grouped MLP calls),
  its forward and both gradients each one call. UNVERIFIED on an NPU (none was available); its calls are
  unit-tested against a CPU stand-in bound by the op's schemas from the torch-npu wheel (tests/npu).
"""

import torch

_GROUPED_MM_CAPABILITIES = (9, 10)  # major compute capabilities with torch._grouped_mm's CUTLASS kernel
_GROUPED_MM_ALIGNMENT_BYTES = 16  # its TMA loads need every row stride 16-byte aligned


def looped_grouped_linear(inputs: torch.Tensor, weights: torch.Tensor, tokens_per_group: torch.Tensor) -> torch.Tensor:
    groups = inputs.split(tokens_per_group.tolist())
    return torch.cat([group @ weight.t() for group, weight in zip(groups, weights)])


def grouped_mm_applies(inputs: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these operands on this GPU."""
    if not hasattr(torch, "_grouped_mm") or inputs.dtype != torch.bfloat16 or weights.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(inputs.device)[0] not in _GROUPED_MM_CAPABILITIES:
        return False
    alignment = _GROUPED_MM_ALIGNMENT_BYTES // inputs.element_size()
    return inputs.shape[1] % alignment == 0 and weights.shape[1] % alignment == 0


def grouped_mm_linear(inputs: torch.Tensor, weights: torch.Tensor, tokens_per_group: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm with the groups given as int32 end offsets on the device; weights go in transposed
    ([groups, in, out], column-major), the layout its kernel reads directly."""
    offsets = torch.cumsum(tokens_per_group.to(inputs.device), dim=0, dtype=torch.int32)
    return torch._grouped_mm(inputs.contiguous(), weights.transpose(-2, -1), offs=offsets)


def cuda_grouped_linear(inputs: torch.Tensor, weights: torch.Tensor, tokens_per_group: torch.Tensor) -> torch.Tensor:
    if grouped_mm_applies(inputs, weights):
        return grouped_mm_linear(inputs, weights, tokens_per_group)
    return looped_grouped_linear(inputs, weights, tokens_per_group)


class _NpuGroupedLinear(torch.autograd.Function):
    """npu_grouped_matmul with x as one tensor split by cumulative row ends (group_list_type=0) and the weights as one
    [groups, K, N] tensor, as MindSpeed's grouped MLP calls it (mindspeed/core/transformer/moe/grouped_matmul_util.py).
    torch-npu 2.10's documentation bounds the other forms: a list of 2-D weights holds at most 128 tensors (one 3-D
    weight up to 1024 groups), and per-group counts (group_list_type=1) may not describe a single group; a rank may
    hold 256 local experts, or one. Forward and input gradient group the rows (group_type=0, one output tensor:
    split_item=3); the weight gradient groups the contraction over tokens (group_type=2: inputs^T [in, tokens] times
    grads [tokens, out] per group, one stacked [groups, in, out] result)."""

    @staticmethod
    def forward(ctx, inputs, weights, tokens_per_group):
        import torch_npu

        ends = torch.cumsum(tokens_per_group.to(device=inputs.device, dtype=torch.int64), dim=0)
        ctx.save_for_backward(inputs, weights, ends)
        (output,) = torch_npu.npu_grouped_matmul(
            [inputs], [weights.transpose(1, 2)], group_list=ends, split_item=3, group_type=0, group_list_type=0
        )
        return output

    @staticmethod
    def backward(ctx, grad_output):
        import torch_npu

        inputs, weights, ends = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        (grad_inputs,) = torch_npu.npu_grouped_matmul(
            [grad_output], [weights], group_list=ends, split_item=3, group_type=0, group_list_type=0
        )
        (grad_weights,) = torch_npu.npu_grouped_matmul(
            [inputs.t()], [grad_output], group_list=ends, split_item=3, group_type=2, group_list_type=0
        )
        return grad_inputs, grad_weights.transpose(-2, -1), None


def npu_grouped_linear(inputs: torch.Tensor, weights: torch.Tensor, tokens_per_group: torch.Tensor) -> torch.Tensor:
    return _NpuGroupedLinear.apply(inputs, weights, tokens_per_group)
