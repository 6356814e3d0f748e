"""megatron-core 0.16.1 on the CPU: its CUDA calls redirected, as narrowly as possible.

megatron-core assumes CUDA in three ways (docs/upstream-facts.md, "megatron-core 0.16.1 on the CPU"); each is redirected
only for megatron-core's own code:

1. `torch.cuda.*` calls and `device="cuda"` literals inside megatron.core modules, e.g.
   `torch.cuda.current_device()` (models/common/embeddings/rotary_pos_embedding.py, distributed/
   param_and_grad_buffer.py, transformer/module.py), `torch.ones(..., device="cuda")` (the causal mask,
   transformer/utils.py), `torch.zeros(..., device="cuda")` (pipeline_parallel/schedules.py,
   optimizer/clip_grads.py), `torch.tensor(..., device='cuda')` (optimizer/optimizer.py).
   Each megatron.core module's global `torch` is swapped, right after the module is executed, for a
   view of torch whose `cuda` is the CPU stand-in and whose tensor factories map a CUDA device to the
   CPU (is_available() keeps torch's answer: megatron asks it only before GPU-only extras). torch
   itself, and every other package, is untouched.
2. The RNG tracker (tensor_parallel/random.py: `model_parallel_cuda_manual_seed`, `CudaRNGStatesTracker`
   and `checkpoint`): its two module functions `_get_cuda_rng_state` / `_set_cuda_rng_state` are replaced
   by ones on the CPU generator, which stands in for the device generator. Forking the tracker therefore
   changes the CPU generator by design, so its "CPU RNG state changed within GPU RNG context" warning is
   filtered (that message only, that logger only).
3. Tensor methods: `tensor.type() == 'torch.cuda.FloatTensor'` checks (optimizer/optimizer.py
   FP32/Float16 optimizers, optimizer/distrib_optimizer.py, optimizer/clip_grads.py) and `tensor.cuda()`
   (optimizer/optimizer.py restore_from_cpu, models/common/language_module). Methods of torch.Tensor can
   only be patched globally, so the patch is scoped by caller: only a call made from a megatron.core
   module sees the CUDA type name or gets the CPU tensor back; everybody else gets torch's behaviour.

4. GatedDeltaNet (ssm/gated_delta_net.py) imports flash-linear-attention's Triton chunk_gated_delta_rule and
   l2norm, and refuses to build without them (HAVE_FLA). On the CPU that module's two names are bound to
   relax.kernels.gdn_reference's torch functions (same signatures; backward by autograd) and HAVE_FLA set.
   causal_conv1d_fn stays None: the module then runs its own nn.Conv1d path.

5. megatron-core's fused elementwise functions (`@jit_fuser`: the norms, gated attention's and GatedDeltaNet's
   output gates, the experts' activations, the router's expert bias) are torch.compile'd upstream. On the CPU that
   means Dynamo tracing and an Inductor C++ build in every process at each function's first call, for nothing a
   test or a tiny run needs: megatron.core.jit's switch is turned off as the module is executed, before any
   megatron module decorates with it, so they run as plain torch.

Applied only by the CPU platform, in the process that calls `prepare_megatron()`; idempotent.
"""

import logging
import sys
import types

import torch

from relax.platform.cpu_device import CpuDeviceModule
from relax.platform.post_import import PostImportHook

_MEGATRON_PACKAGE = "megatron.core"
_RNG_MODULE = "megatron.core.tensor_parallel.random"
_GDN_MODULE = "megatron.core.ssm.gated_delta_net"
_JIT_MODULE = "megatron.core.jit"
_RNG_FORK_WARNING = "CPU RNG state changed within GPU RNG context"
_FACTORIES = (
    "arange",
    "as_tensor",
    "empty",
    "empty_strided",
    "full",
    "ones",
    "rand",
    "randint",
    "randn",
    "tensor",
    "zeros",
)

_prepared = False


def prepare_megatron() -> None:
    global _prepared
    if _prepared:
        return
    PostImportHook(_is_megatron_core, _redirect_module).install()
    torch.Tensor.type = _scoped_type(torch.Tensor.type)
    torch.Tensor.cuda = _scoped_cuda(torch.Tensor.cuda)
    logging.getLogger(_RNG_MODULE).addFilter(_drop_rng_fork_warning)
    _prepared = True


def _is_megatron_core(name: str) -> bool:
    return name == _MEGATRON_PACKAGE or name.startswith(_MEGATRON_PACKAGE + ".")


def _is_cuda_device(device) -> bool:
    if isinstance(device, int):  # a bare index means a CUDA device to torch
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _on_cpu(factory):
    def factory_on_cpu(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    factory_on_cpu.__name__ = factory.__name__
    return factory_on_cpu


def _build_torch_view() -> types.ModuleType:
    """torch as megatron.core sees it on the CPU: `cuda` is the CPU stand-in, factories map CUDA to CPU."""

    cuda_view = types.ModuleType("torch.cuda", "torch.cuda seen by megatron.core on the CPU")
    for name in dir(CpuDeviceModule):
        if not name.startswith("_"):
            setattr(cuda_view, name, getattr(CpuDeviceModule, name))
    # megatron-core asks is_available() only before GPU-only extras (utils.StragglerDetector's CUDA events,
    # empty_cache in activation offloading): there are none here, so its answer stays torch's (False).
    cuda_view.is_available = torch.cuda.is_available
    # Anything the stand-in lacks (FloatTensor types, nvtx, streams) is torch.cuda's own: it either works
    # without a GPU or fails loudly at the call, naming what megatron reached for.
    cuda_view.__getattr__ = lambda name: getattr(torch.cuda, name)

    torch_view = types.ModuleType("torch", "torch seen by megatron.core on the CPU")
    torch_view.cuda = cuda_view
    for name in _FACTORIES:
        setattr(torch_view, name, _on_cpu(getattr(torch, name)))
    torch_view.__getattr__ = lambda name: getattr(torch, name)
    return torch_view


_TORCH_VIEW = _build_torch_view()


def _cpu_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False) -> None:
    torch.set_rng_state(new_state)


def _redirect_module(module: types.ModuleType) -> None:
    if module.__dict__.get("torch") is torch:
        module.torch = _TORCH_VIEW
    if module.__name__ == _RNG_MODULE:
        module._get_cuda_rng_state = _cpu_rng_state
        module._set_cuda_rng_state = _set_cpu_rng_state
    if module.__name__ == _JIT_MODULE:
        module.disable_jit_fuser()
    if module.__name__ == _GDN_MODULE and not module.HAVE_FLA:
        from relax.kernels import gdn_reference

        module.chunk_gated_delta_rule = gdn_reference.chunk_gated_delta_rule
        module.l2norm = gdn_reference.l2norm
        module.HAVE_FLA = True


def _called_from_megatron_core() -> bool:
    return _is_megatron_core(sys._getframe(2).f_globals.get("__name__", ""))


def _scoped_type(tensor_type):
    def type_(self, *args, **kwargs):
        result = tensor_type(self, *args, **kwargs)
        if not args and not kwargs and self.device.type == "cpu" and _called_from_megatron_core():
            return result.replace("torch.", "torch.cuda.", 1)  # 'torch.FloatTensor' -> 'torch.cuda.FloatTensor'
        return result

    type_.__wrapped__ = tensor_type
    return type_


def _scoped_cuda(tensor_cuda):
    def cuda(self, *args, **kwargs):
        if _called_from_megatron_core():
            return self
        return tensor_cuda(self, *args, **kwargs)

    cuda.__wrapped__ = tensor_cuda
    return cuda


def _drop_rng_fork_warning(record: logging.LogRecord) -> bool:
    return record.getMessage() != _RNG_FORK_WARNING
