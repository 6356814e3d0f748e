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
the module's `repatch(args)`, together with the Megatron-LM arguments MindSpeed's checks read
(MINDSPEED_MEGATRON_ARGS).
Before SGLang: torch_npu must be imported so that `torch.npu` exists when SGLang decides its device
(sglang/srt/utils/common.py is_npu() checks hasattr(torch, "npu")).
Memory saver: torch_memory_saver as built by sgl-kernel-npu for Ascend (hook mode "torch" by default).
"""

import re
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

from relax import pins
from relax.platform.base import Platform, frozen

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


# Where a CANN toolkit records its version ("version=9.0.0" / "Version=9.0.0"), in the order tried. The
# names are those seen in CANN installs and Ascend build scripts; not checked on a CANN 9.0.0 install.
CANN_VERSION_FILES = ("*/ascend_toolkit_install.info", "runtime/version.info", "compiler/version.info")


def cann_version(environ: Mapping[str, str]) -> Optional[str]:
    """The CANN toolkit version from its install records, if any."""
    home = Path(
        environ.get("ASCEND_TOOLKIT_HOME")
        or environ.get("ASCEND_HOME_PATH")
        or "/usr/local/Ascend/ascend-toolkit/latest"
    )
    for pattern in CANN_VERSION_FILES:
        for info in sorted(home.glob(pattern)) if home.is_dir() else []:
            match = re.search(r"^version=(\S+)", info.read_text(errors="replace"), re.M | re.I)
            if match:
                return match.group(1)
    return None


# MindSpeed's switches for its fused NPU kernels in megatron-core's own modules (its feature arguments, by dest):
# RMSNorm of megatron's layer specs (LNImpl / WrappedTorchNorm), RoPE (apply_rotary_pos_emb), and the MoE token
# permute / unpermute of the alltoall dispatcher. relax's own modules do not go through them: its core attention calls
# npu_fusion_attention and its grouped experts npu_grouped_matmul already; Qwen3.5's zero-centred RMSNorm and GDN
# layers are relax's own torch. megatron's SwiGLU needs no switch: MindSpeed's FusedSwigluFeature ("use-swiglu",
# optimization level 0, features_manager/fusions/fused_bias_swiglu.py) replaces its SwiGLU functions in every run.
MINDSPEED_FEATURES = (
    "use_fused_rmsnorm",
    "use_fused_rotary_pos_emb",
    "use_fused_moe_token_permute_and_unpermute",
)
# Megatron-LM arguments MindSpeed's checks read from every TransformerConfig that megatron-core's config lacks:
# MindSpeed copies its arguments onto each new config (core/megatron_basic/arguments_basic.py) and validates it with
# each feature's checks; the fused-RoPE check reads position_embedding_type
# (features_manager/fusions/fused_rope.py), an argument of megatron.training, which relax does not use. relax builds
# every model with RoPE (relax.train.model.build_gpt_model; relax.args refuses other position embeddings).
MINDSPEED_MEGATRON_ARGS = {"position_embedding_type": "rope"}

_applied_feature_args: Optional[dict] = None


def prepare_mindspeed(feature_args: Mapping[str, Any]) -> None:
    """torch_npu, then MindSpeed's adaptor (which patches megatron-core at import), then its feature arguments;
    again only when the feature arguments change."""
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
    adaptor.repatch({**MINDSPEED_MEGATRON_ARGS, **feature_args})
    _applied_feature_args = feature_args


class NpuPlatform(Platform):
    name = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource = "NPU"
    memory_saver = "torch_memory_saver"
    # Not measured on an NPU: the memory saver, as the Ascend recipes relax follows use it.
    actor_sleep_route = "memory-saver"
    alloc_conf_env = "PYTORCH_NPU_ALLOC_CONF"
    colocation_needs_release = True
    same_node_transport = "ipc"
    # SGLang's Ascend path rebuilds a handle on the receiving process's own device (an Ascend handle carries no
    # device uuid): a handle from another NPU would be read as the receiver's own memory.
    handles_cross_devices = False
    sglang_server_defaults = frozen({"device": "npu", "attention_backend": "ascend"})
    attention_kernel = "npu_fusion"
    # MindSpeed's own context-parallel attention first (its ring attention over npu_fusion_attention); relax's
    # all-gather only for a row the ring cannot take (relax.platform.attention.mindspeed_ring_takes).
    context_parallel_attention = "mindspeed-ring"
    # MindSpeed's triton-ascend chunked rule and l2norm (forward and backward, packed rows): MindSpeed is in the image
    # and its adaptor puts the same functions at flash-linear-attention's entry points on every NPU rank.
    gdn_training_kernel = "mindspeed"
    # relax's logprob kernels are written to triton-ascend's porting rules but were never run on an NPU: torch until
    # they are.
    logprob_kernel = "torch"
    megatron_features = MINDSPEED_FEATURES
    pinned_versions = frozen({
        "torch": pins.TORCH_NPU_TORCH,
        "torch-npu": pins.TORCH_NPU,
        "triton-ascend": pins.TRITON_ASCEND,
        "mindspeed": pins.MINDSPEED_VERSION,
    })
    patches_required = True
    toolkit = "CANN"
    toolkit_pin = pins.CANN_NPU_IMAGE.split(":")[1].split("-")[0]  # the CANN release of the image's tag
    triton_target = "ascend"

    @property
    def device_module(self):
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        return torch.npu

    def unavailable_reason(self) -> Optional[str]:
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError as error:
            return f"torch_npu does not import ({error}); install the Ascend stack (docker/Dockerfile.npu)"
        import torch

        if not torch.npu.is_available() or torch.npu.device_count() == 0:
            return "torch_npu sees no NPU (check the driver, the CANN environment and ASCEND_RT_VISIBLE_DEVICES)"
        return None

    def load_memory_saver(self):
        import torch_memory_saver  # sgl-kernel-npu's Ascend build; its default hook mode is "torch"

        return torch_memory_saver.torch_memory_saver

    def worker_env(self, memory_saver_on: bool = False) -> dict:
        env = dict(WORKER_ENV)
        if not memory_saver_on:
            env[self.alloc_conf_env] = EXPANDABLE_SEGMENTS
        return env

    def check_worker_env(self, env, memory_saver_on: bool = False) -> None:
        """Also refuses TMS_HOOK_MODE=preload: that hook mode works only in a process started with the saver's hook
        library in LD_PRELOAD, and relax starts its actors (and SGLang its schedulers) without one; relax's NPU
        memory saver runs in the torch hook mode, which needs nothing at start."""
        super().check_worker_env(env, memory_saver_on)
        if env.get("TMS_HOOK_MODE", "").strip().lower() == "preload":
            raise ValueError(
                "TMS_HOOK_MODE=preload: torch_memory_saver's preload hooks need its library in LD_PRELOAD of every "
                "actor and engine process, which relax does not set; unset TMS_HOOK_MODE (or set it to torch): relax "
                "runs the memory saver in the torch hook mode"
            )

    def prepare_megatron(self, feature_args=None) -> None:
        prepare_mindspeed(dict(feature_args or {}))

    def prepare_sglang(self) -> None:
        import torch_npu  # noqa: F401

    def grouped_linear(self, inputs, weights, tokens_per_group):
        from relax.platform.grouped_linear import npu_grouped_linear

        return npu_grouped_linear(inputs, weights, tokens_per_group)

    def toolkit_version(self, environ) -> Optional[str]:
        return cann_version(environ)

    def triton_compute_units(self, device_index: int) -> int:
        """Vector cores: relax's kernels have no matrix-unit work. The count its kernels in sgl-kernel-npu size their
        grids with, read the same way. Unverified: no NPU was available."""
        from relax.kernels.sgl_kernel_npu.launch import vector_cores

        return vector_cores(device_index)
