"""x * sigmoid(gate) for SGLang's Ascend models: Qwen3.5's attention output gate (a gate per element) and the
shared expert's gate of Qwen2-MoE-style blocks (one gate per row, broadcast over it). Reference:
relax.kernels.gdn_reference.sigmoid_mul (float32 math, the result in x's dtype)."""

import torch
import triton
import triton.language as tl

from .launch import grid_size

MAX_BLOCK = 1024  # columns per work item: x, gate and the product in float32 stay at 12 KB of the unified buffer


@triton.jit
def _sigmoid_mul_kernel(x_ptr, gate_ptr, out_ptr, rows, cols, x_row_stride, gate_row_stride, gate_col_stride,
                        out_row_stride, BLOCK: tl.constexpr):
    """One work item = BLOCK columns of one row; gate_col_stride 0 reads one gate per row."""
    blocks_per_row = tl.cdiv(cols, BLOCK)
    offs = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), rows * blocks_per_row, tl.num_programs(0)):
        row = item // blocks_per_row
        columns = (item % blocks_per_row) * BLOCK + offs
        mask = columns < cols
        x = tl.load(x_ptr + row * x_row_stride + columns, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + row * gate_row_stride + columns * gate_col_stride, mask=mask,
                       other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + columns, (x * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty),
                 mask=mask)


def _launch(x: torch.Tensor, gate: torch.Tensor, gate_col_stride: int, num_programs: int | None) -> torch.Tensor:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, D] with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    rows, cols = x.shape
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(max(cols, 1)), MAX_BLOCK)
    items = rows * triton.cdiv(cols, block)
    if items:
        _sigmoid_mul_kernel[(grid_size(items, x.device, num_programs),)](
            x, gate, out, rows, cols, x.stride(0), gate.stride(0), gate_col_stride, out.stride(0), BLOCK=block)
    return out


def fused_sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, num_programs: int | None = None) -> torch.Tensor:
    """x * sigmoid(gate) as a new tensor of x's dtype; x and gate [N, D] with contiguous rows.
    num_programs: the grid's bound (default: the NPU's vector cores)."""
    if gate.shape != x.shape or gate.stride(-1) != 1:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)} with contiguous rows, got {tuple(gate.shape)} "
                         f"strides {gate.stride()}")
    return _launch(x, gate, 1, num_programs)


def fused_sigmoid_mul_broadcast(x: torch.Tensor, gate: torch.Tensor, num_programs: int | None = None) -> torch.Tensor:
    """x * sigmoid(gate) with one gate per row of x [N, D]: gate [N, 1] or [N]. A new tensor of x's dtype."""
    if gate.shape not in ((x.shape[0], 1), (x.shape[0],)):
        raise ValueError(f"gate must be [{x.shape[0]}, 1] or [{x.shape[0]}] (one per row of x), got "
                         f"{tuple(gate.shape)}")
    return _launch(x, gate, 0, num_programs)
