"""A torch_npu stand-in for CPU tests: `torch.npu`, the modules SGLang and MindSpeed import, and the ops relax and
MindSpeed call, computed in torch.

Real torch_npu (Ascend/pytorch) registers `torch.npu` and the "npu" device type when imported (torch imports it
through the `torch.backends` entry point it ships). This package sets `torch.npu` to a module of the parts SGLang's
import path reads, reporting no NPU until stand_in_one_npu() makes the process see one (SGLang then takes its NPU
branches, `is_npu()`). Nothing here computes on a device: a device call that would need one raises StandInError
naming the call. The ops of tests/npu/torch_npu_ops.py (`torch_npu.npu_swiglu`, ...) are bound by the wheel's
schemas and compute on the CPU; any other `npu_*` attribute raises StandInError when called.
"""

import sys
import types

import torch

DEVICE_COUNT = 0  # NPUs this process sees: none, or one after stand_in_one_npu()


class StandInError(RuntimeError):
    """Raised by any torch_npu stand-in that would need a real Ascend NPU."""


def _needs_device(name: str):
    def call(*args, **kwargs):
        raise StandInError(f"torch_npu.{name} is a CPU stand-in (tests/npu/stand_ins/torch_npu): no NPU to run it")

    call.__name__ = name.rsplit(".", 1)[-1]
    call.__qualname__ = name
    return call


npu = types.ModuleType("torch_npu.npu", "The stand-in of torch_npu.npu, also installed as torch.npu.")
npu.is_available = lambda: DEVICE_COUNT > 0
npu.device_count = lambda: DEVICE_COUNT
npu.current_device = lambda: 0
npu.set_device = lambda device: None
npu.synchronize = lambda device=None: None
npu.is_initialized = lambda: True
npu.init = lambda: None
npu.get_device_name = lambda device=None: "Ascend910_9382 (stand-in)"
npu.empty_cache = lambda: None
npu.memory_allocated = lambda device=None: 0
npu.max_memory_allocated = lambda device=None: 0
npu.memory_reserved = lambda device=None: 0
npu.reset_peak_memory_stats = lambda device=None: None
npu.manual_seed = lambda seed: None
npu.manual_seed_all = lambda seed: None
npu.is_bf16_supported = lambda: True
# Settings SGLang makes when it initialises its NPU backend (hardware_backend/npu/utils.py init_npu_backend).
npu.set_compile_mode = lambda jit_compile=False: None
npu.config = types.SimpleNamespace(allow_internal_format=False)
for _name in ("mem_get_info", "get_device_properties", "Stream", "Event", "current_stream", "stream", "NPUGraph",
              "graph", "NpuGraphOpHandler", "register_npu_graph_handler"):
    setattr(npu, _name, _needs_device(f"npu.{_name}"))
del _name

torch.npu = npu
sys.modules["torch.npu"] = npu
sys.modules[__name__ + ".npu"] = npu

from torch_npu import _torchair  # noqa: E402  (needs StandInError above)

_torchair.install()

from torch_npu import profiler  # noqa: E402,F401  (an attribute of torch_npu, as in the real package)
from tests.npu import torch_npu_ops  # noqa: E402

torch_npu_ops.install(sys.modules[__name__])


def stand_in_one_npu() -> None:
    """This process sees one NPU: torch_npu's name for the PrivateUse1 device ("npu", so torch.device("npu") parses)
    and torch.npu reporting one device. Not for a process that torch.compiles: torch then takes "npu" for its
    accelerator, which has no device hooks in this CPU build, and dynamo's first question to it (the current
    stream) fails with "PyTorch is not linked with support for npu devices"."""
    global DEVICE_COUNT
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    DEVICE_COUNT = 1


def _apply_patches(patches) -> None:
    """Set torch's attributes as torch_npu does: each patch is [dotted path under torch, replacement]."""
    for path, replacement in patches:
        owner_path, _, attribute = path.rpartition(".")
        owner = torch
        for part in owner_path.split(".") if owner_path else []:
            owner = getattr(owner, part)
        setattr(owner, attribute, replacement)


def __getattr__(name: str):
    # torch_npu's ops (npu_fusion_attention, npu_grouped_matmul, ...) exist as attributes; calling one needs an NPU.
    if name.startswith(("npu_", "_npu_")):
        return _needs_device(name)
    raise AttributeError(f"module 'torch_npu' (CPU stand-in) has no attribute {name!r}")
