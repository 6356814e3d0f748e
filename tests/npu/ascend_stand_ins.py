"""Stand-ins for the compiled Ascend packages the real MindSpeed imports (torch_npu, torchair), for running its Python
on a CPU, and triton-ascend's tolerance of autotune keys.

Every module under those packages imports; every name in them is a placeholder that fails when called, naming itself,
so a CPU run passes only where MindSpeed does not compute with an Ascend operator. The exceptions, each with why:
- `torch_npu` sets `torch.npu` to its `npu` module, as the real package registers that module at import (MindSpeed's
  annotations read torch.npu.Stream);
- `torch_npu.unsupported_dtype` is an empty list (MindSpeed's dist_train module tests dtypes against it at import);
- `torch_npu._C._distributed_c10d.ProcessGroupHCCL` is a class (ProcessGroupHCCL below says why);
- calling a torchair name returns a decorator that changes nothing: MindSpeed registers graph-mode converters with
  torchair at import (op_builder/*_builder.py register_op_ir), which a CPU run never reaches.
triton: MindSpeed's Triton kernels (ops/triton/cumsum.py) autotune on keys that are not kernel arguments; the Triton
triton-ascend 3.2 is built on leaves such keys out, the Triton installed here (3.x later) refuses them at decoration.
install_ascend_stand_ins() drops such keys before Triton's check."""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

STOOD_IN = ("torch_npu", "torchair")


class AscendPart:
    """A name of a stood-in package: attributes are further names, calling it fails (torchair: see the module)."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        if self._name.startswith("torchair."):
            return lambda function: function
        raise RuntimeError(f"{self._name} is a compiled Ascend part, stood in on this CPU run: it cannot compute here")

    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return AscendPart(f"{self._name}.{attribute}")


class ProcessGroupHCCL:
    """HCCL's process group, whose Options here have no hccl_config: MindSpeed's wrapper of megatron's process-group
    options (functional/profiler/profiler_info.py) then leaves them as they are, its path for torch_npu versions
    without that attribute, which the gloo groups of a CPU run need."""

    class Options:
        pass


class StoodInModule(types.ModuleType):
    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return AscendPart(f"{self.__name__}.{attribute}")


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STOOD_IN:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StoodInModule(spec.name)
        module.__path__ = []
        module.__file__ = f"<stand-in for {spec.name}>"  # MindSpeed's op builders take the package's directory
        return module

    def exec_module(self, module):
        if module.__name__ == "torch_npu":
            import torch

            module.npu = torch.npu = importlib.import_module("torch_npu.npu")
            module.unsupported_dtype = []
            module._C = importlib.import_module("torch_npu._C")
        elif module.__name__ == "torch_npu._C":
            module._distributed_c10d = importlib.import_module("torch_npu._C._distributed_c10d")
        elif module.__name__ == "torch_npu._C._distributed_c10d":
            module.ProcessGroupHCCL = ProcessGroupHCCL


def _autotune_keys_of_arguments_only() -> None:
    from triton.runtime import autotuner

    checked_init = autotuner.Autotuner.__init__

    def __init__(self, fn, arg_names, configs, key, *args, **kwargs):
        checked_init(self, fn, arg_names, configs, [name for name in key if name in arg_names], *args, **kwargs)

    autotuner.Autotuner.__init__ = __init__


def install_ascend_stand_ins() -> None:
    if not any(isinstance(finder, StandInFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, StandInFinder())
        _autotune_keys_of_arguments_only()
