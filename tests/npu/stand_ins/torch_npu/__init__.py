"""A torch_npu stand-in for CPU tests: it makes `torch.npu` exist and report one available NPU.

Real torch_npu (Ascend/pytorch) registers `torch.npu` and the "npu" device type when imported (torch imports it
through the `torch.backends` entry point it ships). This package does the same for the parts SGLang's import path
reads, so that SGLang takes its NPU branches (`is_npu()`) on a CPU. Nothing here computes on a device: a device
call that would need one raises StandInError naming the call. Op stand-ins (`torch_npu.npu_*`) are attached by
tests/npu's op module; without it an `npu_*` attribute raises StandInError when called.
"""

import sys
import types

import torch

DEVICE_COUNT = 1


class StandInError(RuntimeError):
    """Raised by any torch_npu stand-in that would need a real Ascend NPU."""


def _needs_device(name: str):
    def call(*args, **kwargs):
        raise StandInError(f"torch_npu.{name} is a CPU stand-in (tests/npu/stand_ins/torch_npu): no NPU to run it")

    call.__name__ = name.rsplit(".", 1)[-1]
    call.__qualname__ = name
    return call


npu = types.ModuleType("torch_npu.npu", "The stand-in of torch_npu.npu, also installed as torch.npu.")
npu.is_available = lambda: True
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

# torch_npu names the PrivateUse1 backend "npu"; torch.device("npu") then parses.
if torch._C._get_privateuse1_backend_name() != "npu":
    torch.utils.rename_privateuse1_backend("npu")
torch.npu = npu
sys.modules["torch.npu"] = npu
sys.modules[__name__ + ".npu"] = npu

from torch_npu import _torchair  # noqa: E402  (needs StandInError above)

_torchair.install()

from torch_npu import profiler  # noqa: E402,F401  (an attribute of torch_npu, as in the real package)


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
