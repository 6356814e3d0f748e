"""The base class of the platform records: what every device states (class attributes) and does (methods).

One subclass per device (relax.platform.cpu, .cuda, .npu), one instance each (relax.platform.PLATFORMS). Facts are
plain class attributes, readable on any machine; methods that need the device import its libraries when called.
"""

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from types import MappingProxyType
from typing import Any, Mapping, Optional

from relax.kernels.launch import TritonLaunch, triton_launch


class Platform(ABC):
    name: str  # "cpu" | "cuda" | "npu"; also the torch device type and SGLang's ServerArgs.device
    dist_backend: str  # torch.distributed backend: gloo | nccl | hccl
    visible_devices_env: Optional[str]  # CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES; None on CPU
    ray_resource: Optional[str]  # "GPU" / "NPU"; None on CPU (placement bundles ask for CPUs only)
    # Module that pauses and resumes tagged device memory (SGLang's enable_memory_saver, the actor's
    # sleep/wake). None: memory is never handed back (on CPU, release/resume are no-ops).
    memory_saver: Optional[str]
    # How the sleeping actor hands its device memory back by default (--actor-sleep-route auto): "memory-saver"
    # (the memory saver pauses the training state's region) or "host-copies" (relax.train.offload.HostCopies).
    actor_sleep_route: str
    # The allocator setting (PYTORCH_{CUDA,NPU}_ALLOC_CONF) whose expandable segments a memory saver cannot work
    # with; None where there is no device allocator.
    alloc_conf_env: Optional[str]
    # Must the engine release its memory for training to fit beside it? Not where memory is host memory.
    colocation_needs_release: bool
    # How a trainer hands tensors to an engine process on the same node: "ipc" (device IPC handles,
    # zero-copy) or "inline" (the bytes of CPU tensors inside the payload).
    same_node_transport: str
    # Can an engine rank open a tensor handle made on another device of its node? If not, each engine rank
    # takes its weights from the training rank on its own device, and other devices' from a broadcast
    # (relax.sync.broadcast.plan_pushes).
    handles_cross_devices: bool
    # ServerArgs field overrides the engine wrapper applies on this platform (before the user's flags).
    sglang_server_defaults: Mapping[str, Any]
    # The training actor's causal attention (relax.platform.attention.KERNELS).
    attention_kernel: str
    # How the actor's attention reaches the keys of other context-parallel ranks
    # (relax.platform.attention.CONTEXT_PARALLEL_ATTENTION): "all-gather" (relax's own, with attention_kernel) or
    # "mindspeed-ring" (MindSpeed's ring attention, relax's all-gather for the rows it cannot take).
    context_parallel_attention: str
    # The training actor's default chunked gated delta rule (relax.kernels.gdn_training.GDN_TRAINING_KERNELS).
    gdn_training_kernel: str
    # How the training actor computes per-token logprobs and entropies over the vocabulary
    # (relax.train.logprobs.LOGPROB_KERNELS): "triton" (one-pass fused kernels) or "torch" (pieces of positions).
    logprob_kernel: str
    # Feature switches of the platform's Megatron adaptation layer (MindSpeed on NPU) that relax passes on from its
    # flags of the same names (prepare_megatron's feature_args); empty where Megatron runs without one.
    megatron_features: tuple[str, ...]
    # Distributions this platform runs on beyond the common stack, by name, with the version relax is pinned to
    # (`relax doctor` compares the installed ones).
    pinned_versions: Mapping[str, str]
    # Whether relax's patch sets (patches/) must be applied to the installed sglang and megatron-core.
    patches_required: bool
    # The device toolkit the platform needs ("NVIDIA driver", "CANN") and the version expected of it (None: any);
    # toolkit None where none is needed.
    toolkit: Optional[str]
    toolkit_pin: Optional[str]
    # The Triton target relax's kernels compile for here ("nvidia", "ascend", or "interpreter": TRITON_INTERPRET on
    # the host); relax.kernels.launch keeps each target's launch tuning.
    triton_target: str

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        missing = [fact for fact in Platform.__annotations__ if not hasattr(cls, fact)]
        if missing:
            raise TypeError(f"platform {cls.__name__} does not state {', '.join(missing)}")

    def __repr__(self) -> str:
        return f"<platform {self.name}>"

    @property
    def device_type(self) -> str:
        return self.name

    @property
    def has_memory_saver(self) -> bool:
        return self.memory_saver is not None

    @property
    @abstractmethod
    def device_module(self):
        """torch.cuda, torch.npu, or the CPU stand-in with the same calls (device_count, set_device, ...)."""

    @abstractmethod
    def unavailable_reason(self) -> Optional[str]:
        """Why this machine cannot compute on this platform, or None when it can."""

    @abstractmethod
    def load_memory_saver(self):
        """What releases and resumes this process's tagged device memory (the training actor's sleep and
        wake): torch_memory_saver's singleton, set up for this platform, with `region(tag)` around
        allocations, `pause(tag)` and `resume(tag)`; where there is none, a stand-in whose calls do nothing.
        (SGLang's engine manages its own, through ServerArgs.enable_memory_saver.)"""

    @abstractmethod
    def worker_env(self, memory_saver_on: bool = False) -> dict:
        """Environment variables every worker process (Ray actor) of this platform starts with.

        Values are defaults: the caller merges the user's own environment over them, then passes the
        result through `check_worker_env`.
        """

    def check_worker_env(self, env: Mapping[str, str], memory_saver_on: bool = False) -> None:
        """Raise ValueError, naming the variable and the fix, if a worker's final environment contradicts
        what this platform needs: expandable segments beside a memory saver, which needs fixed allocations it
        can unmap and map again (torch_memory_saver refuses to start beside them); fail before the workers
        start rather than inside them."""
        variable = self.alloc_conf_env
        if memory_saver_on and variable and alloc_conf_has_expandable_segments(env.get(variable, "")):
            raise ValueError(
                f"{variable}={env[variable]!r} turns on expandable segments, which the memory saver "
                f"({self.memory_saver}) cannot work with: drop expandable_segments from it, or turn the memory "
                "saver off"
            )

    @abstractmethod
    def prepare_megatron(self, feature_args: Optional[Mapping[str, Any]] = None) -> None:
        """Everything that must happen before megatron.core is imported. Idempotent.

        feature_args: options of the platform's Megatron adaptation layer (on NPU, MindSpeed's feature
        arguments by dest name, e.g. {"use_fused_rmsnorm": True}); platforms without one refuse them.
        """

    @abstractmethod
    def prepare_sglang(self) -> None:
        """Everything that must happen before sglang is imported. Idempotent."""

    def sglang_engine_processes(self) -> AbstractContextManager:
        """Held by an SGLang engine of this process from before it starts to after its processes are gone: how it
        starts its scheduler and detokenizer processes. SGLang's own way (spawned) unless a platform says
        otherwise."""
        return nullcontext()

    @abstractmethod
    def grouped_linear(self, inputs, weights, tokens_per_group):
        """[tokens, in] rows in consecutive groups of tokens_per_group[g] rows, each group times weights[g]
        ([groups, out, in]) transposed: [tokens, out], differentiable. This platform's grouped matrix product
        (relax.platform.grouped_linear), which MoE experts run once per projection."""

    def toolkit_version(self, environ: Mapping[str, str]) -> Optional[str]:
        """The installed version of the platform's toolkit, None when it is not found (or none is needed)."""
        return None

    @abstractmethod
    def triton_compute_units(self, device_index: int) -> int:
        """The units of device `device_index` that Triton programs run on (a GPU's multiprocessors, an NPU's vector
        cores), which relax.kernels.launch sizes its grids by. Raises where Triton cannot run here."""

    def triton_launch(self, device_index: int) -> TritonLaunch:
        """The launch record relax's Triton kernels take on device `device_index`: its Triton target's tuning scaled
        to its compute units (relax.kernels.launch). Raises where Triton cannot run here."""
        return triton_launch(self.triton_target, self.triton_compute_units(device_index))

    def device_count(self) -> int:
        return self.device_module.device_count()

    def current_device(self):
        """The torch.device this process computes on."""
        import torch

        current = self.device_module.current_device()  # an index, or the CPU stand-in's torch.device
        return current if isinstance(current, torch.device) else torch.device(self.name, current)

    def set_device(self, index: int) -> None:
        """Select the device this process computes on (its local rank among visible devices)."""
        self.device_module.set_device(index)


def frozen(mapping: Mapping) -> Mapping:
    """A read-only view, for the mapping facts of a platform."""
    return MappingProxyType(dict(mapping))


def refuse_feature_args(platform_name: str, feature_args: Optional[Mapping[str, Any]]) -> None:
    """For platforms whose Megatron runs without an adaptation layer."""
    if feature_args:
        raise ValueError(
            f"Megatron feature arguments {sorted(feature_args)} are for the NPU's adaptation layer "
            f"(MindSpeed); the {platform_name!r} platform has none: remove them"
        )


def alloc_conf_has_expandable_segments(alloc_conf: str) -> bool:
    """Whether a PYTORCH_{CUDA,NPU}_ALLOC_CONF value turns expandable segments on."""
    options = dict(item.split(":", 1) for item in alloc_conf.replace(" ", "").split(",") if ":" in item)
    return options.get("expandable_segments", "False").lower() in ("true", "1")
