"""The device relax runs on: one record per platform holding its facts.

This package is the only code in relax that knows which device it runs on. Everything else asks the
record returned by `get_platform()`: which torch device and module to use, which process-group backend,
which variable selects visible devices, which Ray resource to request, how memory is released, how
tensors reach an engine on the same node, what environment workers get, and what must happen before
Megatron or SGLang is imported. Never write `if device == "npu"` outside this package: add a field.

    platform = get_platform()          # "auto": RELAX_DEVICE if set, else npu > cuda > cpu
    platform.prepare_megatron()        # before `import megatron.core`
    platform.prepare_sglang()          # before `import sglang`
    torch.distributed.init_process_group(platform.dist_backend, ...)

`platform_facts(name)` returns the same record without checking that this machine has the device, for
code that only reads facts (argument checks and `--dry-run` of a GPU/NPU script on a CPU machine).

Verification: the CPU record runs real megatron-core and SGLang in tests/e2e; the CUDA record's
selection logic is unit-tested here and its execution only on a lent GPU (tests/gpu); the NPU record's
selection and environment logic are unit-tested, NPU EXECUTION IS UNVERIFIED (no NPU was available).
"""

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

PLATFORM_NAMES = ("cpu", "cuda", "npu")
DEVICE_ENV = "RELAX_DEVICE"  # overrides "auto" detection; workers inherit it, so a whole job agrees


@dataclass(frozen=True)
class TritonLaunch:
    """How relax's Triton kernels (relax.kernels.gdn_triton) launch on one device: the grid bound and launch
    keywords every kernel takes, and the fused GDN decode kernel's tiling, which
    relax.kernels.gdn_triton.decode_tiling turns into one call's block_v / programs_per_group / launch.
    Tests and benchmarks may build one themselves; engines take their platform's `triton_launch`."""

    num_programs: int  # upper bound of the 1-D grid: NPU vector cores, or GPU SMs x programs resident per SM
    options: Mapping[str, Any] = field(default_factory=dict)  # launch keywords (num_warps, num_stages); {} on NPU
    # gdn_decode: state rows per on-chip tile when one program does a key head's whole group of value heads.
    decode_block_v: int = 64
    # gdn_decode: a key head's group is split over several programs only while rows x key heads x programs per
    # group stays at most this many work items (small batches, where one program per group leaves the device
    # mostly idle); 0: never split.
    decode_split_items: int = 0
    decode_split_min_block_v: int = 16  # the smallest state tile a split may take
    # launch keywords a split launch sets over `options` (e.g. num_stages=2: load each tile one step ahead)
    decode_split_options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Platform:
    name: str  # "cpu" | "cuda" | "npu"; also the torch device type and SGLang's ServerArgs.device
    dist_backend: str  # torch.distributed backend: gloo | nccl | hccl
    visible_devices_env: Optional[str]  # CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES; None on CPU
    ray_resource: Optional[str]  # "GPU" / "NPU"; None on CPU (placement bundles ask for CPUs only)
    # Module that pauses and resumes tagged device memory (SGLang's enable_memory_saver, the actor's
    # sleep/wake). None: memory is never handed back (on CPU, release/resume are no-ops).
    memory_saver: Optional[str]
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
    # The training actor's default chunked gated delta rule (relax.kernels.gdn_training.GDN_TRAINING_KERNELS).
    gdn_training_kernel: str
    # Feature switches of the platform's Megatron adaptation layer (MindSpeed on NPU) that relax passes on from its
    # flags of the same names (prepare_megatron's feature_args); empty where Megatron runs without one.
    megatron_features: tuple[str, ...]
    _load_device_module: Callable[[], Any] = field(repr=False)
    _unavailable_reason: Callable[[], Optional[str]] = field(repr=False)
    _worker_env: Callable[[bool], dict] = field(repr=False)
    _check_worker_env: Callable[[Mapping[str, str], bool], None] = field(repr=False)
    _load_memory_saver: Callable[[], Any] = field(repr=False)
    _prepare_megatron: Callable[[Mapping[str, Any]], None] = field(repr=False)
    _prepare_sglang: Callable[[], None] = field(repr=False)
    _triton_launch: Callable[[int], TritonLaunch] = field(repr=False)
    _grouped_linear: Callable[..., Any] = field(repr=False)

    @property
    def device_type(self) -> str:
        return self.name

    @property
    def has_memory_saver(self) -> bool:
        return self.memory_saver is not None

    @property
    def device_module(self):
        """torch.cuda, torch.npu, or the CPU stand-in with the same calls (device_count, set_device, ...)."""
        return self._load_device_module()

    def unavailable_reason(self) -> Optional[str]:
        """Why this machine cannot compute on this platform, or None when it can."""
        return self._unavailable_reason()

    def load_memory_saver(self):
        """What releases and resumes this process's tagged device memory (the training actor's sleep and
        wake): torch_memory_saver's singleton, set up for this platform, with `region(tag)` around
        allocations, `pause(tag)` and `resume(tag)`; where there is none, a stand-in whose calls do nothing.
        (SGLang's engine manages its own, through ServerArgs.enable_memory_saver.)"""
        return self._load_memory_saver()

    def worker_env(self, memory_saver_on: bool = False) -> dict:
        """Environment variables every worker process (Ray actor) of this platform starts with.

        Values are defaults: the caller merges the user's own environment over them, then passes the
        result through `check_worker_env`.
        """
        if memory_saver_on and not self.has_memory_saver:
            raise ValueError(
                f"platform {self.name!r} has no memory saver; turn the memory saver off on this device"
            )
        return dict(self._worker_env(memory_saver_on))

    def check_worker_env(self, env: Mapping[str, str], memory_saver_on: bool = False) -> None:
        """Raise ValueError, naming the variable and the fix, if a worker's final environment contradicts
        what this platform needs (e.g. expandable segments beside a memory saver)."""
        self._check_worker_env(env, memory_saver_on)

    def prepare_megatron(self, feature_args: Optional[Mapping[str, Any]] = None) -> None:
        """Everything that must happen before megatron.core is imported. Idempotent.

        feature_args: options of the platform's Megatron adaptation layer (on NPU, MindSpeed's feature
        arguments by dest name, e.g. {"use_fused_rmsnorm": True}); platforms without one refuse them.
        """
        self._prepare_megatron(dict(feature_args or {}))

    def prepare_sglang(self) -> None:
        """Everything that must happen before sglang is imported. Idempotent."""
        self._prepare_sglang()

    def triton_launch(self, device_index: int) -> TritonLaunch:
        """How relax's 1-D-grid Triton kernels launch on device `device_index`: the most programs worth
        launching, extra launch keywords such as num_warps, and the fused GDN decode kernel's tiling. Raises
        where Triton cannot compile (the CPU without TRITON_INTERPRET=1)."""
        return self._triton_launch(device_index)

    def grouped_linear(self, inputs, weights, tokens_per_group):
        """[tokens, in] rows in consecutive groups of tokens_per_group[g] rows, each group times weights[g]
        ([groups, out, in]) transposed: [tokens, out], differentiable. This platform's grouped matrix product
        (relax.platform.grouped_linear), which MoE experts run once per projection."""
        return self._grouped_linear(inputs, weights, tokens_per_group)

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


def detect_platform_name(
    npu_available: Optional[Callable[[], bool]] = None,
    cuda_available: Optional[Callable[[], bool]] = None,
) -> str:
    """npu if torch_npu imports and sees an NPU, else cuda if torch sees a GPU, else cpu.

    The probes are injectable so the order can be tested on a machine without accelerators.
    """
    npu_available = npu_available or (lambda: platform_facts("npu").unavailable_reason() is None)
    cuda_available = cuda_available or (lambda: platform_facts("cuda").unavailable_reason() is None)
    if npu_available():
        return "npu"
    if cuda_available():
        return "cuda"
    return "cpu"


def resolve_platform_name(name: str = "auto", environ: Optional[Mapping[str, str]] = None, **probes) -> str:
    """Turn "auto" (or RELAX_DEVICE) into a concrete platform name; reject unknown names."""
    environ = os.environ if environ is None else environ
    if name == "auto":
        name = environ.get(DEVICE_ENV, "auto").strip().lower() or "auto"
        source = f"{DEVICE_ENV}={environ.get(DEVICE_ENV)!r}"
    else:
        source = f"device {name!r}"
    if name == "auto":
        return detect_platform_name(**probes)
    if name not in PLATFORM_NAMES:
        raise ValueError(f"unknown {source}: choose one of auto, {', '.join(PLATFORM_NAMES)}")
    return name


def platform_facts(name: str) -> Platform:
    """The record for a platform name, whether or not this machine has the device. Read facts from it;
    compute through `get_platform`, which checks the device is there."""
    if name not in PLATFORM_NAMES:
        raise ValueError(f"unknown device {name!r}: choose one of {', '.join(PLATFORM_NAMES)}")
    from relax.platform import cpu, cuda, npu

    return {"cpu": cpu.PLATFORM, "cuda": cuda.PLATFORM, "npu": npu.PLATFORM}[name]


def get_platform(name: str = "auto") -> Platform:
    """The record for `name` ("auto", "cpu", "cuda", "npu"), checked usable here: an explicit name whose
    device this machine lacks fails with a RuntimeError saying what is missing."""
    platform = platform_facts(resolve_platform_name(name))
    reason = platform.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"device {platform.name!r} was asked for, but {reason}; or pass --device cpu")
    return platform


def frozen(mapping: Mapping) -> Mapping:
    """A read-only view, for the mapping fields of a frozen record."""
    return MappingProxyType(dict(mapping))


def refuse_feature_args(platform_name: str, feature_args: Mapping[str, Any]) -> None:
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
