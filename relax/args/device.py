"""Which device a run uses, and the one fact about it that argument checking needs.

Stand-in until relax/platform lands: `resolve_device` is the only place in relax/args that knows about
devices, and it moves to relax.platform (get_platform(name)) unchanged in meaning.
"""

import importlib.util
from typing import NamedTuple

# Per platform: (can the rollout engine release and resume its memory: SGLang's memory saver, i.e.
# torch_memory_saver; must it, for training to fit beside it). Host memory is shared, so the CPU need not.
_MEMORY_FACTS = {"cpu": (False, False), "cuda": (True, True), "npu": (True, True)}


class DeviceFacts(NamedTuple):
    name: str  # "cpu" | "cuda" | "npu": also SGLang's ServerArgs.device
    has_memory_saver: bool
    colocation_needs_release: bool


def resolve_device(requested: str) -> DeviceFacts:
    """`--device auto|cpu|cuda|npu` -> the platform. An explicit name is taken as given (so a GPU run
    script can be dry-run on a CPU machine); only `auto` looks at the machine."""
    name = requested if requested != "auto" else _detect()
    has_memory_saver, colocation_needs_release = _MEMORY_FACTS[name]
    return DeviceFacts(name, has_memory_saver, colocation_needs_release)


def _detect() -> str:
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers torch.npu)
        import torch

        if torch.npu.is_available():
            return "npu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
