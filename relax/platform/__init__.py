"""The device relax runs on: one Platform per device (relax.platform.base), holding its facts and doing its work.

This package is the only code in relax that knows which device it runs on. Everything else asks the
record returned by `get_platform()`: which torch device and module to use, which process-group backend,
which variable selects visible devices, which Ray resource to request, how memory is released, how
tensors reach an engine on the same node, what environment workers get, and what must happen before
Megatron or SGLang is imported. Never write `if device == "npu"` outside this package: add a fact (a class
attribute of Platform) or a method.

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
from typing import Callable, Mapping, Optional

from relax.platform.base import Platform
from relax.platform.cpu import CpuPlatform
from relax.platform.cuda import CudaPlatform
from relax.platform.npu import NpuPlatform

# Every platform relax runs on, by name: the one list of device names (flags, `relax doctor`, RELAX_DEVICE).
PLATFORMS: Mapping[str, Platform] = {p.name: p for p in (CpuPlatform(), CudaPlatform(), NpuPlatform())}
PLATFORM_NAMES = tuple(PLATFORMS)
DEVICE_CHOICES = ("auto", *PLATFORM_NAMES)  # what --device takes
DEVICE_ENV = "RELAX_DEVICE"  # overrides "auto" detection; workers inherit it, so a whole job agrees


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
        raise ValueError(f"unknown {source}: choose one of {', '.join(DEVICE_CHOICES)}")
    return name


def platform_facts(name: str) -> Platform:
    """The record for a platform name, whether or not this machine has the device. Read facts from it;
    compute through `get_platform`, which checks the device is there."""
    if name not in PLATFORMS:
        raise ValueError(f"unknown device {name!r}: choose one of {', '.join(PLATFORM_NAMES)}")
    return PLATFORMS[name]


def get_platform(name: str = "auto") -> Platform:
    """The record for `name` ("auto", "cpu", "cuda", "npu"), checked usable here: an explicit name whose
    device this machine lacks fails with a RuntimeError saying what is missing."""
    platform = platform_facts(resolve_platform_name(name))
    reason = platform.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"device {platform.name!r} was asked for, but {reason}; or pass --device cpu")
    return platform
