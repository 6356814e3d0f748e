"""Stand-in of torch_npu.profiler: SGLang swaps torch.profiler's profile and activities for these at import
(utils/profile_utils.py); profiling itself needs an NPU."""

import enum

from torch_npu import _needs_device


class ProfilerActivity(enum.Enum):
    CPU = "CPU"
    NPU = "NPU"


profile = _needs_device("profiler.profile")
tensorboard_trace_handler = _needs_device("profiler.tensorboard_trace_handler")
