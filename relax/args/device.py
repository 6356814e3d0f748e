"""Which device a run uses, and the facts about it that argument checking needs.

The name comes from relax.platform (same `auto` detection and RELAX_DEVICE as every other part of relax).
The memory facts are kept here because a relax.platform record can only be built on a machine that has
the device, while `--dry-run` must check a GPU or NPU run script on a CPU machine. They belong in
relax.platform as facts readable without the device; then `resolve_device` reads them from there.
"""

from typing import NamedTuple

from relax.platform import get_platform, resolve_platform_name

# Per platform: (can the rollout engine release and resume its memory: SGLang's memory saver, i.e.
# torch_memory_saver; must it, for training to fit beside it). Host memory is shared, so the CPU need not.
# Agrees with relax.platform's records (memory_saver is None on cpu, torch_memory_saver on cuda/npu).
_MEMORY_FACTS = {"cpu": (False, False), "cuda": (True, True), "npu": (True, True)}


class DeviceFacts(NamedTuple):
    name: str  # "cpu" | "cuda" | "npu": also SGLang's ServerArgs.device
    has_memory_saver: bool
    colocation_needs_release: bool


def resolve_device(requested: str) -> DeviceFacts:
    """`--device auto|cpu|cuda|npu` -> the platform. An explicit name is taken as given (so a GPU run
    script can be dry-run on a CPU machine); only `auto` looks at the machine."""
    name = resolve_platform_name(requested)
    has_memory_saver, colocation_needs_release = _MEMORY_FACTS[name]
    return DeviceFacts(name, has_memory_saver, colocation_needs_release)


def prepare_sglang_import(requested: str) -> None:
    """Run the platform's step that must come before the first `import sglang` in this process.

    Parsing imports SGLang's ServerArgs, and SGLang decides its device at import (is_cpu() is cached,
    the CPU engine needs SGLANG_USE_CPU_ENGINE=1 first; relax.platform.cpu_sglang). The requested platform
    is prepared when this machine has it; otherwise (a dry run of a GPU/NPU script on a CPU machine) the
    machine's own platform is, since that is where this process would run SGLang.
    """
    for name in (requested, "auto"):
        try:
            platform = get_platform(name)
        except RuntimeError:  # that device is not on this machine
            continue
        platform.prepare_sglang()
        return
