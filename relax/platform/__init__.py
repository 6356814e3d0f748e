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
"""

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

PLATFORM_NAMES = ("cpu", "cuda", "npu")
DEVICE_ENV = "RELAX_DEVICE"  # overrides "auto" detection; workers inherit it, so a whole job agrees


@dataclass(frozen=True)
class Platform:
    name: str  # "cpu" | "cuda" | "npu"; also the torch device type
    device_module: Any  # torch.cuda, torch.npu, or the CPU stand-in with the same calls
    dist_backend: str  # torch.distributed backend: gloo | nccl | hccl
    visible_devices_env: Optional[str]  # CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES; None on CPU
    ray_resource: Optional[str]  # "GPU" / "NPU"; None on CPU (placement bundles ask for CPUs only)
    # Module that pauses and resumes tagged device memory (SGLang's --enable-memory-saver, the actor's
    # sleep/wake). None means memory is never handed back: on CPU release/resume are no-ops.
    memory_saver: Optional[str]
    # How a trainer hands tensors to an engine process on the same node: "ipc" (device IPC handles,
    # zero-copy) or "shared_memory" (CPU tensors in /dev/shm).
    same_node_transport: str
    # torch.multiprocessing sharing strategy the sender must set; None keeps torch's default.
    sharing_strategy: Optional[str]
    # Seconds to wait after destroying process groups before creating new ones on the same devices.
    destroy_process_group_delay_s: float
    # ServerArgs field overrides the engine wrapper applies on this platform (before the user's flags).
    sglang_server_defaults: Mapping[str, Any]
    _worker_env: Callable[[bool], dict] = field(repr=False)
    _prepare_megatron: Callable[[], None] = field(repr=False)
    _prepare_sglang: Callable[[], None] = field(repr=False)

    @property
    def device_type(self) -> str:
        return self.name

    @property
    def has_memory_saver(self) -> bool:
        return self.memory_saver is not None

    def worker_env(self, memory_saver_on: bool = False) -> dict:
        """Environment variables every worker process (Ray actor) of this platform starts with.

        Values are defaults: the caller merges them under the user's own environment, which wins.
        """
        if memory_saver_on and not self.has_memory_saver:
            raise ValueError(
                f"platform {self.name!r} has no memory saver; turn the memory saver off on this device"
            )
        return dict(self._worker_env(memory_saver_on))

    def prepare_megatron(self) -> None:
        """Everything that must happen before megatron.core is imported. Idempotent."""
        self._prepare_megatron()

    def prepare_sglang(self) -> None:
        """Everything that must happen before sglang is imported. Idempotent."""
        self._prepare_sglang()

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
    from relax.platform import cuda, npu

    npu_available = npu_available or npu.is_available
    cuda_available = cuda_available or cuda.is_available
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


_PLATFORMS: dict = {}


def get_platform(name: str = "auto") -> "Platform":
    """The record for `name` ("auto", "cpu", "cuda", "npu"). An explicit name whose device is not
    usable here fails with a RuntimeError saying what is missing."""
    name = resolve_platform_name(name)
    if name not in _PLATFORMS:
        from relax.platform import cpu, cuda, npu

        builders = {"cpu": cpu.build_platform, "cuda": cuda.build_platform, "npu": npu.build_platform}
        _PLATFORMS[name] = builders[name]()
    return _PLATFORMS[name]


def frozen(mapping: Mapping) -> Mapping:
    """A read-only view, for the mapping fields of a frozen record."""
    return MappingProxyType(dict(mapping))
