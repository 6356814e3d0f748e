"""SGLang 0.5.23 on the CPU: its CPU engine switch and stand-ins for what PyPI cannot give a CPU.

Needed before sglang is imported, in this process and in the scheduler/detokenizer processes SGLang
spawns (they inherit the environment, so everything here goes through os.environ):

1. SGLANG_USE_CPU_ENGINE=1: SGLang 0.5.23 treats the device as CPU only when this is set before import
   (sglang/srt/platforms/__init__.py, utils/common.py); without it the model build reaches
   `from vllm._custom_ops import rotary_embedding` and fails.
2. relax/platform/cpu_stand_ins first on PYTHONPATH (and sys.path), which holds
   - `sgl_kernel`: PyPI's sgl-kernel is CUDA-only (no CPU ops, no sdist), and with the CPU engine switch
     SGLang imports CPU ops from it at module level. Measured for tiny Qwen2/Qwen3 generation: the engine
     imports assign_req_to_token_pool_cpu (mem_cache/allocation.py; called on its speculative-decoding
     allocation path), copy_all_layer_kv_cache_cpu and six speculative-decoding ops
     (assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu, build_tree_kernel_efficient_cpu,
     fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu, verify_tree_greedy_cpu), and calls none of them.
     relax/platform/cpu_sgl_kernel_registry.py implements ops in torch; any other op raises when called.
   - `torchvision`: a placeholder, because PyPI's torchvision does not import beside the CPU torch and
     SGLang's engine import reaches it through its multimodal configs.

3. SGLANG_MAMBA_CONV_DTYPE=float32 (unless set): SGLang 0.5.23 keeps the GDN / mamba conv state of hybrid models
   (Qwen3.5, Qwen3-Next) in bfloat16 by default whatever --dtype says (configs/mamba_utils.py); on the CPU, the
   debug platform, relax wants float32 engines to agree with HF: measured logprob gaps 1.2e-4 with the bf16
   conv state, 4.8e-7 with float32 (tiny Qwen3.5, docs/upstream-facts.md).

4. The engine's scheduler and detokenizer processes are forked from one server process that has imported them
   (engine_processes_from_a_forkserver), not spawned, each importing SGLang anew: on the CPU, where an engine's
   start is mostly Python imports, that saves the CPU time of one SGLang import per engine start (measured on
   the tiny Qwen3: the engine's processes 16 CPU-s spawned, 8.5 forked from the server).

Engine flags that make the engine run on a CPU live in relax.platform.cpu.SGLANG_SERVER_DEFAULTS.
"""

import multiprocessing
import multiprocessing.forkserver
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

from relax.platform.post_import import PostImportHook

STAND_INS_DIR = str(Path(__file__).with_name("cpu_stand_ins"))
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
MAMBA_CONV_DTYPE_ENV = "SGLANG_MAMBA_CONV_DTYPE"


def prepare_sglang() -> None:
    if os.environ.get(CPU_ENGINE_ENV) != "1" and "sglang" in sys.modules:
        raise RuntimeError(
            "sglang was imported before the CPU platform was prepared: call "
            "relax.platform.get_platform().prepare_sglang() before the first `import sglang`"
        )
    os.environ[CPU_ENGINE_ENV] = "1"
    os.environ.setdefault(MAMBA_CONV_DTYPE_ENV, "float32")
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if STAND_INS_DIR not in python_path:
        os.environ["PYTHONPATH"] = os.pathsep.join([STAND_INS_DIR, *python_path])
    if STAND_INS_DIR not in sys.path:
        sys.path.insert(0, STAND_INS_DIR)


# ----------------------------------------------------------------------------------------------------------
# CPUs without AMX (SGLang 0.5.23). SGLang takes its CPU-op paths only where cpu_has_amx_support() is true
# and otherwise falls to Triton kernels, which fail on a CPU. Measured on this machine (no AMX) for Qwen3.5 /
# Qwen3-Next: the gated RMSNorm of the GDN layers (kernels/ops/attention/fla/layernorm_gated.py RMSNorm and
# fused_norm_gate.py FusedRMSNormGated: both test a module-level `_use_cpu = is_cpu() and
# cpu_has_amx_support()`) and the MoE shared-expert gate (srt/models/qwen2_moe.py calls the Triton
# fused_gate_sigmoid_mul_add unless the gate layer is AMX-packed). Each of these three modules is adjusted right
# after it executes, in every SGLang process (install_non_amx_fallbacks runs where the sgl_kernel stand-in is
# imported): the norms take the sgl_kernel CPU op path (served by relax), the gate gets a torch function.
# ----------------------------------------------------------------------------------------------------------
def _take_cpu_op_path(module) -> None:
    module._use_cpu = True


def shared_expert_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states) -> None:
    """final_hidden_states += sigmoid(hidden_states @ gate_weight) * shared_output, in place (the semantics of
    sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul_add; gate_weight [hidden])."""
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float().reshape(-1, 1))
    final_hidden_states.add_((gate * shared_output.float()).to(final_hidden_states.dtype))


def _torch_shared_expert_gate(module) -> None:
    module.fused_gate_sigmoid_mul_add = shared_expert_gate_sigmoid_mul_add


_NON_AMX_FALLBACKS = {
    "sglang.kernels.ops.attention.fla.layernorm_gated": _take_cpu_op_path,
    "sglang.kernels.ops.attention.fla.fused_norm_gate": _take_cpu_op_path,
    "sglang.srt.models.qwen2_moe": _torch_shared_expert_gate,
}


def _apply_non_amx_fallback(module) -> None:
    from sglang.srt.utils import cpu_has_amx_support

    if not cpu_has_amx_support():
        _NON_AMX_FALLBACKS[module.__name__](module)


_fallbacks_installed = False


def install_non_amx_fallbacks() -> None:
    """Adjust the modules above and below when they are imported (and those already imported) in this
    process; once."""
    global _fallbacks_installed
    if os.environ.get(CPU_ENGINE_ENV) != "1" or _fallbacks_installed:
        return
    PostImportHook(_NON_AMX_FALLBACKS.__contains__, _apply_non_amx_fallback).install()
    PostImportHook(_SEEDED_SAMPLING.__contains__, lambda module: _SEEDED_SAMPLING[module.__name__](module)).install()
    PostImportHook(_HOST_BUFFERS.__contains__, lambda module: _HOST_BUFFERS[module.__name__](module)).install()
    _fallbacks_installed = True


# ----------------------------------------------------------------------------------------------------------
# Seeded sampling (--sglang-enable-deterministic-inference) on the CPU. SGLang 0.5.23 honours a request's
# sampling_seed only under deterministic inference, which (a) accepts only GPU/NPU attention backends
# (arg_groups/overrides.py _deterministic_attention_backend; torch_native is the CPU's one) and (b) turns on
# batch-invariant mode, whose kernels are Triton GPU kernels and whose setup raises "No supported accelerator"
# on a CPU (model_runner.maybe_enable_batch_invariant_mode). relax admits torch_native through SGLang's own
# add_deterministic_attention_backend_choices and leaves batch-invariant mode off: the seeded sampler
# (Gumbel noise hashed from seed and position) is what makes a resumed run sample what the original would;
# a batch of the same prompts gives the same logits on the CPU without batch invariance.
# ----------------------------------------------------------------------------------------------------------
def _admit_torch_native(module) -> None:
    if "torch_native" not in module.DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        module.add_deterministic_attention_backend_choices(["torch_native"])


def _skip_batch_invariant_mode(module) -> None:
    module.ModelRunner.maybe_enable_batch_invariant_mode = lambda self: None


def _uncompiled_seeded_multinomial(module) -> None:
    # torch.compile'd upstream; on the CPU that means a C++ build at the first seeded request, and a graph break
    # at the hash op anyway (relax's murmur_hash32_cpu, a torch function in relax.platform.cpu_sgl_kernel_registry).
    module.multinomial_with_seed = module.multinomial_with_seed._torchdynamo_orig_callable


_SEEDED_SAMPLING = {
    "sglang.srt.arg_groups.choices": _admit_torch_native,
    "sglang.srt.model_executor.model_runner": _skip_batch_invariant_mode,
    "sglang.srt.layers.sampler": _uncompiled_seeded_multinomial,
}


# ----------------------------------------------------------------------------------------------------------
# Routed experts (--use-rollout-routing-replay) on the CPU. SGLang 0.5.23's capturer keeps each token's experts
# in a host buffer allocated through mem_cache/pool_host/common.py ALLOC_MEMORY_FUNCS, whose entry for "cpu" pins
# the memory with cudaHostRegister: "Torch not compiled with CUDA enabled" in the scheduler at start. Pinning only
# speeds up copies from an accelerator, which the CPU engine has none of: its host buffers are plain memory.
# ----------------------------------------------------------------------------------------------------------
def _plain_host_buffer(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return torch.empty(dims, dtype=dtype, device=device)


def _unpinned_host_buffers(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _plain_host_buffer


_HOST_BUFFERS = {"sglang.srt.mem_cache.pool_host.common": _unpinned_host_buffers}


# ----------------------------------------------------------------------------------------------------------
# The engine's processes forked from a server that has imported them. SGLang 0.5.23's Engine sets the spawn start
# method (entrypoints/engine.py _set_envs_and_config) and starts its scheduler and detokenizer with that module's
# `mp.Process`: spawned, each imports SGLang, about 5 CPU-s apiece on a 2-core machine. Here they come from
# Python's forkserver with the two modules preloaded: the server imports SGLang once and forks both. A forked
# process has the server's environment, taken when the server started: the server starts with the first engine of
# this process and stops when no engine of the process is left, so an engine started after a change of the
# environment (a test's switch) gets a server that has it, unless another engine of the process still runs. The
# server is the processes' parent: SGLang's children die with it (PR_SET_PDEATHSIG) and it dies with this process.
# Why a server of its own, not a fork of this process (which has imported SGLang too): a process forked from one that
# has run torch's OpenMP ops hangs in its first parallel op (seen here: a matmul in the parent, then the same in a
# forked child never returns), and this process (an engine actor, a test process) may have run some.
# ----------------------------------------------------------------------------------------------------------
ENGINE_PROCESS_MODULES = ["sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager"]
_forkserver_users = 0
_forkserver_lock = threading.Lock()


@contextmanager
def engine_processes_from_a_forkserver():
    """Held from before an SGLang Engine starts until its processes are gone (relax.rollout.engine.RolloutEngine):
    its processes are forked from the forkserver, which stops when no engine of this process holds it."""
    global _forkserver_users
    import sglang.srt.entrypoints.engine as engine_module

    with _forkserver_lock:
        if _forkserver_users == 0:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(ENGINE_PROCESS_MODULES)
            # The Engine calls mp.set_start_method("spawn", force=True), then mp.Process and mp.Pipe.
            engine_module.mp = SimpleNamespace(
                Process=context.Process, Pipe=context.Pipe, set_start_method=lambda *args, **kwargs: None
            )
        _forkserver_users += 1
    try:
        yield
    finally:
        with _forkserver_lock:
            _forkserver_users -= 1
            if _forkserver_users == 0:
                engine_module.mp = multiprocessing
                multiprocessing.forkserver._forkserver._stop()
