"""Ascend NPUs: torch_npu, HCCL, ASCEND_RT_VISIBLE_DEVICES, Ray "NPU" bundles, MindSpeed.

NPU EXECUTION IS UNVERIFIED: no NPU and no torch_npu exist on the machines relax is developed on.
What is tested (tests/unit/test_platform.py) is the selection and environment logic only: detection
with an injected probe, the worker environment as a dict, the clear failure when torch_npu is missing.
"""

from relax.platform import Platform


def is_available() -> bool:
    """True when torch_npu imports and sees at least one NPU."""
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return False
    import torch

    return torch.npu.is_available() and torch.npu.device_count() > 0


def build_platform() -> Platform:
    # The full record (HCCL, worker environment, MindSpeed) lands in the next change.
    raise RuntimeError("device 'npu' is not supported by this version of relax yet; pass --device cpu or cuda")
