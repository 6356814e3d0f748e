"""Stand-ins for the compiled Ascend packages the real MindSpeed imports (torch_npu, torchair), for running its Python
on a CPU, and triton-ascend's tolerance of autotune keys.

Every module under those packages imports; every name in them is a placeholder that fails when called, naming itself,
so a CPU run passes only where MindSpeed does not compute with an Ascend operator. The exceptions, each with why:
- `torch_npu` sets `torch.npu` to its `npu` module, as the real package registers that module at import (MindSpeed's
  annotations read torch.npu.Stream);
- `torch_npu.unsupported_dtype` is an empty list (MindSpeed's dist_train module tests dtypes against it at import);
- the ops of torch_npu_ops.py (`torch_npu.npu_swiglu`, `npu_rms_norm`, ...): bound by the wheel's schemas and
  computed in torch, as in tests/npu/stand_ins' torch_npu, so MindSpeed's fused functions run;
- `torch_npu._C._distributed_c10d.ProcessGroupHCCL` is a class (ProcessGroupHCCL below says why);
- `torch_npu.npu`'s device generator, lazy call and current device, and `torch.cuda.current_device` pointed at the
  latter by the transfer_to_npu stand-in (exec_module says why);
- calling a torchair name returns a decorator that changes nothing: MindSpeed registers graph-mode converters with
  torchair at import (op_builder/*_builder.py register_op_ir), which a CPU run never reaches.
MindSpeed's own compiled ops: its op builders (mindspeed/op_builder) compile C++ against CANN and torch_npu when an op
is first called; the stand-in of that build serves the ops below, computed in torch, and fails for any other, naming it.
triton: MindSpeed's Triton kernels (ops/triton/cumsum.py) autotune on keys that are not kernel arguments; the Triton
triton-ascend 3.2 is built on leaves such keys out, the Triton installed here (3.x later) refuses them at decoration.
install_ascend_stand_ins() drops such keys before Triton's check."""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

from tests.npu import torch_npu_ops

STOOD_IN = ("torch_npu", "torchair")
ROTATE_HALF, ROTATE_INTERLEAVED = 0, 1  # the modes of MindSpeed's npu_rotary_position_embedding


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


# Stood-in modules that MindSpeed reaches as attributes of their package (`from torch_npu.contrib import
# transfer_to_npu`, `torch_npu._C._distributed_c10d.ProcessGroupHCCL`): imported on attribute access.
SUBMODULES = {"torch_npu.npu", "torch_npu.contrib", "torch_npu.contrib.transfer_to_npu", "torch_npu._C",
              "torch_npu._C._distributed_c10d"}


class StoodInModule(types.ModuleType):
    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        name = f"{self.__name__}.{attribute}"
        return importlib.import_module(name) if name in SUBMODULES else AscendPart(name)


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
        if module.__name__ == "torch_npu.contrib.transfer_to_npu":
            import torch

            # transfer_to_npu points torch.cuda's calls at torch.npu at import; the one MindSpeed's CPU-reachable
            # code calls is current_device (core/megatron_basic/megatron_basic.py, _set_cuda_rng_state).
            torch.cuda.current_device = importlib.import_module("torch_npu.npu").current_device
        elif module.__name__ == "torch_npu":
            import torch

            module.npu = torch.npu = importlib.import_module("torch_npu.npu")
            module.unsupported_dtype = []
            torch_npu_ops.install(module)
        elif module.__name__ == "torch_npu.npu":
            import torch

            # The device's random generator and lazy initialisation (MindSpeed's _set_cuda_rng_state,
            # core/megatron_basic/megatron_basic.py): the CPU generator stands in for the device's, as relax's CPU
            # platform makes it stand in for CUDA's (relax.platform.cpu_megatron), and a lazy call runs at once.
            module.default_generators = (torch.default_generator,)
            module._lazy_call = lambda callback: callback()
            module.current_device = lambda: 0
        elif module.__name__ == "torch_npu._C._distributed_c10d":
            module.ProcessGroupHCCL = ProcessGroupHCCL


def npu_rotary_position_embedding(x, cos, sin, mode=ROTATE_HALF):
    """MindSpeed's fused RoPE (ops/csrc/cann/npu_rotary_position_embedding.cpp, CANN's aclnnRotaryPositionEmbedding):
    x * cos + rotate(x) * sin, rotating halves (mode 0, GPT-NeoX) or adjacent pairs (mode 1, GPT-J), with the checks of
    its CheckRopeFroward."""
    import torch

    def require(condition: bool, message: str) -> None:
        if not condition:
            raise RuntimeError(f"mindspeed npu_rotary_position_embedding: {message}")

    floats = (torch.float32, torch.float16, torch.bfloat16)
    require(all(t.dtype in floats for t in (x, cos, sin)), "x, cos and sin must be float32, float16 or bfloat16")
    require(x.dim() == cos.dim() == sin.dim() == 4, "x, cos and sin must be 4-dimensional")
    require(x.shape[3] % 2 == 0, f"the head dim must be even, got {x.shape[3]}")
    require(cos.shape == sin.shape, "cos and sin must have one shape")
    require(mode in (ROTATE_HALF, ROTATE_INTERLEAVED), f"mode must be 0 (rotate half) or 1 (interleaved), got {mode}")
    if mode == ROTATE_HALF:
        first, second = x.chunk(2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


# The op modules MindSpeed's builders would compile, by builder name, with the ops relax's runs reach.
COMPILED_MINDSPEED_OPS = {
    "npu_rotary_position_embedding": types.SimpleNamespace(npu_rotary_position_embedding=npu_rotary_position_embedding),
}


def _load_compiled_mindspeed_op(builder, verbose=True):
    if builder.name not in COMPILED_MINDSPEED_OPS:
        raise RuntimeError(
            f"MindSpeed's {builder.name} is an op compiled against CANN (mindspeed/op_builder), stood in on this CPU "
            "run: it cannot compute here"
        )
    return COMPILED_MINDSPEED_OPS[builder.name]


def install_mindspeed_op_stand_ins() -> None:
    """MindSpeed's op builders load the stand-ins above instead of compiling. Once MindSpeed is importable; it imports
    no megatron."""
    from mindspeed.op_builder.builder import MindSpeedOpBuilder

    MindSpeedOpBuilder.load = _load_compiled_mindspeed_op


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
