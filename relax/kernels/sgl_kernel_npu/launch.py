"""The grid of relax's kernels in sgl-kernel-npu: one program per vector core, programs looping over work items.

triton-ascend runs each program of a grid on one core and schedules grids larger than the device in waves, so its
porting guide asks vector kernels for a 1-D grid of at most the vector cores, each program striding over the work.
"""

import functools

import torch
import triton


@functools.lru_cache(maxsize=None)
def vector_cores(device_index: int) -> int:
    """The vector cores of NPU `device_index`, as triton-ascend's driver reports them."""
    return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["num_vectorcore"])


def grid_size(work_items: int, device: torch.device, num_programs: int | None) -> int:
    """Programs of a 1-D launch over `work_items`: at most `num_programs`, or when None the NPU's vector cores."""
    if num_programs is None:
        if device.type != "npu":
            raise ValueError(f"tensors on {device}: without num_programs the grid is sized from an NPU's vector "
                             "cores; pass num_programs on other devices (e.g. under TRITON_INTERPRET=1)")
        num_programs = vector_cores(device.index or 0)
    if num_programs < 1:
        raise ValueError(f"num_programs={num_programs}: give at least 1")
    return max(1, min(work_items, num_programs))
