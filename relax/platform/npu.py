"""Ascend NPUs: torch_npu, HCCL, ASCEND_RT_VISIBLE_DEVICES, Ray "NPU" bundles, MindSpeed.

NPU EXECUTION IS UNVERIFIED: no NPU and no torch_npu exist on the machines relax is developed on.
What is tested (tests/unit/test_platform.py) is the selection and environment logic only: detection
with an injected probe, the worker environment as a dict, the refusals, and that the preparation imports
what it should in the order it should (with stand-in modules for torch_npu and MindSpeed).

Before Megatron: MindSpeed (Ascend/MindSpeed, branch core_r0.16.0, pinned in relax/pins.py) patches
megatron-core when `mindspeed.megatron_adaptor` is imported (its module body runs patch_features(), which
also imports torch_npu.contrib.transfer_to_npu), so it must come before the first `import megatron`.
At import it reads its feature flags from sys.argv with parse_known_args; in a Ray actor sys.argv holds
Ray's worker flags, so relax hides them during the import and applies feature arguments explicitly with
the module's `repatch(args)`.
Before SGLang: torch_npu must be imported so that `torch.npu` exists when SGLang decides its device
(sglang/srt/utils/common.py is_npu() checks hasattr(torch, "npu")).
Memory saver: torch_memory_saver as built by sgl-kernel-npu for Ascend (hook mode "torch" by default).
"""

import sys
from typing import Any, Mapping, Optional

from relax.platform import Platform, TritonLaunch, alloc_conf_has_expandable_segments, frozen, grouped_linear

ALLOC_CONF_ENV = "PYTORCH_NPU_ALLOC_CONF"
MINDSPEED_ADAPTOR = "mindspeed.megatron_adaptor"

# Defaults for every worker, each with why. Sources: Ascend's CANN environment-variable reference and
# the environments of Ascend SGLang test scripts, MindSpeed-LLM and MindSpeed-RL examples.
WORKER_ENV = {
    # HCCL waits 120 s by default for all ranks to join a communicator. In colocated RL the ranks of a new
    # group (training groups, weight-update groups to engines) arrive minutes apart while checkpoints load
    # or engines generate. MindSpeed-RL's runtime_env and MindSpeed-LLM's examples use 1800.
    "HCCL_CONNECT_TIMEOUT": "1800",
    # A started collective waits for slow peers at most this long (CANN default about 1800 s); a rollout of
    # long responses keeps peers away longer than that. MindSpeed-RL's runtime_env uses 3600.
    "HCCL_EXEC_TIMEOUT": "3600",
    # Colocation puts several HCCL processes on one NPU (the training actor and SGLang's scheduler). HCCL's
    # fixed default ports (16666 on the NPU side) then collide ("The IP address and port have been bound
    # already"); CANN recommends port ranges for several processes per device, and "auto" lets the OS pick,
    # as Ascend SGLang test scripts do. Used instead of HCCL_IF_BASE_PORT, which every process on a device
    # would need offset by hand. CANN: not supported on Atlas A2 with MC2 fused communication operators.
    "HCCL_HOST_SOCKET_PORT_RANGE": "auto",
    "HCCL_NPU_SOCKET_PORT_RANGE": "auto",
    # Level-1 operator dispatch queue: the host enqueues kernels ahead of the device. Relax's Ascend scripts
    # ran the actor and SGLang's engines (which capture decode graphs) with 1; MindSpeed-LLM's training-only
    # examples use 2.
    "TASK_QUEUE_ENABLE": "1",
    # Bind each process's threads to the CPU cores next to its NPU (coarse binding), to stop host-side
    # dispatch from stalling on cores shared with other processes (MindSpeed-LLM's examples use 1).
    "CPU_AFFINITY_CONF": "1",
}
# Expandable segments (virtual-memory segments that grow) cut fragmentation, so Ascend setups turn them
# on; a memory saver needs fixed allocations it can unmap and map again, so not while one is on.
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def _unavailable_reason() -> Optional[str]:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError as error:
        return f"torch_npu does not import ({error}); install the Ascend stack (docker/Dockerfile.npu)"
    import torch

    if not torch.npu.is_available() or torch.npu.device_count() == 0:
        return "torch_npu sees no NPU (check the driver, the CANN environment and ASCEND_RT_VISIBLE_DEVICES)"
    return None


def _worker_env(memory_saver_on: bool) -> dict:
    env = dict(WORKER_ENV)
    if not memory_saver_on:
        env[ALLOC_CONF_ENV] = EXPANDABLE_SEGMENTS
    return env


def _check_worker_env(env: Mapping[str, str], memory_saver_on: bool) -> None:
    if memory_saver_on and alloc_conf_has_expandable_segments(env.get(ALLOC_CONF_ENV, "")):
        raise ValueError(
            f"{ALLOC_CONF_ENV}={env[ALLOC_CONF_ENV]!r} turns on expandable segments, which the memory saver "
            "cannot work with: drop expandable_segments from it, or turn the memory saver off"
        )


def _load_memory_saver():
    import torch_memory_saver  # sgl-kernel-npu's Ascend build; its default hook mode is "torch"

    return torch_memory_saver.torch_memory_saver


# MindSpeed's switches for its fused NPU kernels in megatron-core's own modules (its feature arguments, by dest):
# RMSNorm of megatron's layer specs (LNImpl / WrappedTorchNorm), megatron's SwiGLU, RoPE (apply_rotary_pos_emb), and
# the MoE token permute / unpermute of the alltoall dispatcher. relax's own modules do not go through them: its core
# attention calls npu_fusion_attention and its grouped experts npu_grouped_matmul already; Qwen3.5's zero-centred
# RMSNorm and GDN layers are relax's own torch.
MINDSPEED_FEATURES = (
    "use_fused_rmsnorm",
    "use_fused_swiglu",
    "use_fused_rotary_pos_emb",
    "use_fused_moe_token_permute_and_unpermute",
)

_applied_feature_args: Optional[dict] = None


def _prepare_megatron(feature_args: Mapping[str, Any]) -> None:
    global _applied_feature_args
    feature_args = dict(feature_args)
    if _applied_feature_args == feature_args:
        return
    if MINDSPEED_ADAPTOR not in sys.modules and any(name.startswith("megatron") for name in sys.modules):
        raise RuntimeError(
            "megatron was imported before MindSpeed patched it: call "
            "relax.platform.get_platform().prepare_megatron() before the first `import megatron`"
        )
    import torch_npu  # noqa: F401

    argv, sys.argv = sys.argv, sys.argv[:1]  # MindSpeed parses sys.argv at import; see the module docstring
    try:
        import mindspeed.megatron_adaptor as adaptor
    finally:
        sys.argv = argv
    if feature_args:
        adaptor.repatch(feature_args)
    _applied_feature_args = feature_args


def _prepare_sglang() -> None:
    import torch_npu  # noqa: F401


def _device_module():
    import torch
    import torch_npu  # noqa: F401

    return torch.npu


def _triton_launch(device_index: int) -> TritonLaunch:
    """One program per vector core (relax's kernels have no matrix-unit work) and no num_warps/num_stages,
    as triton-ascend's porting rules ask. gdn_decode keeps TritonLaunch's defaults (64-row tiles, never split
    a key head's group): no other tiling was measured on an NPU. Unverified: no NPU was available."""
    import triton

    properties = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return TritonLaunch(num_programs=int(properties["num_vectorcore"]))


PLATFORM = Platform(
    name="npu",
    dist_backend="hccl",
    visible_devices_env="ASCEND_RT_VISIBLE_DEVICES",
    ray_resource="NPU",
    memory_saver="torch_memory_saver",
    colocation_needs_release=True,
    same_node_transport="ipc",
    # SGLang's Ascend path rebuilds a handle on the receiving process's own device (an Ascend handle carries no
    # device uuid): a handle from another NPU would be read as the receiver's own memory.
    handles_cross_devices=False,
    sglang_server_defaults=frozen({"device": "npu", "attention_backend": "ascend"}),
    attention_kernel="npu_fusion",
    # flash-linear-attention's Triton kernels are not built for triton-ascend; the torch reference always runs
    gdn_training_kernel="reference",
    megatron_features=MINDSPEED_FEATURES,
    _load_device_module=_device_module,
    _unavailable_reason=_unavailable_reason,
    _worker_env=_worker_env,
    _check_worker_env=_check_worker_env,
    _load_memory_saver=_load_memory_saver,
    _prepare_megatron=_prepare_megatron,
    _prepare_sglang=_prepare_sglang,
    _triton_launch=_triton_launch,
    _grouped_linear=grouped_linear.npu_grouped_linear,
)
