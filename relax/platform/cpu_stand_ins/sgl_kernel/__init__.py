"""relax's stand-in for sgl_kernel on the CPU platform (see relax/platform/cpu_sgl_kernel_registry.py).

Only relax's CPU platform puts this directory on the path (prepare_sglang); it shadows any sgl_kernel.
"""

import sys
import types

import torch

from relax.platform.cpu_sgl_kernel_registry import CPU_OPS, missing_op

__version__ = "0.0.0+relax.cpu.stand.in"
__path__ = []  # a package whose only submodules are the stand-ins made below


def _make_module(qualified_name: str) -> types.ModuleType:
    module = sys.modules.get(qualified_name)
    if module is None:
        module = types.ModuleType(qualified_name, f"relax stand-in for {qualified_name}")
        module.__path__ = []
        module.__getattr__ = lambda name: missing_op(f"{qualified_name}.{name}")
        sys.modules[qualified_name] = module
        parent, _, child = qualified_name.rpartition(".")
        setattr(sys.modules[parent], child, module)  # so that sgl_kernel.mamba.name works as well
    return module


_torch_library = torch.library.Library("sgl_kernel", "FRAGMENT")  # kept alive: it owns the definitions
for _op in CPU_OPS.values():
    _home = _make_module(f"{__name__}.{_op.submodule}") if _op.submodule else sys.modules[__name__]
    setattr(_home, _op.name, _op.function)
    if _op.schema is not None:
        _torch_library.define(_op.name + _op.schema)
        _torch_library.impl(_op.name, _op.function, "CPU")


def __getattr__(name):
    return missing_op(f"{__name__}.{name}")
