"""The CPU platform's stand-in for torch.cuda / torch.npu (relax.platform.cpu's device module; megatron-core's view of
torch.cuda on the CPU, relax.platform.cpu_megatron)."""

import torch


class CpuDeviceModule:
    """Stand-in for torch.cuda / torch.npu on the CPU: one device, always current, nothing to sync."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> torch.device:
        # A torch.device rather than an index: callers pass it straight to `device=` arguments.
        return torch.device("cpu")

    @staticmethod
    def set_device(device) -> None:
        if torch.device("cpu", 0) != _as_cpu_index_device(device):
            raise ValueError(f"device {device!r} does not exist on the CPU platform: it has one device, 0")

    @staticmethod
    def synchronize(device=None) -> None:
        """CPU ops are synchronous."""

    @staticmethod
    def empty_cache() -> None:
        """The CPU allocator keeps no cache to hand back."""

    @staticmethod
    def memory_allocated(device=None) -> int:
        return 0

    # The device generator is the CPU generator (megatron's RNG tracker forks it like a CUDA one).
    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)
    manual_seed = staticmethod(torch.manual_seed)
    manual_seed_all = staticmethod(torch.manual_seed)


def _as_cpu_index_device(device) -> torch.device:
    if isinstance(device, int):
        return torch.device("cpu", device)
    device = torch.device(device)
    return torch.device("cpu", device.index or 0) if device.type == "cpu" else device
