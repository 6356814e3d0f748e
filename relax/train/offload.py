"""Moving the actor's tensors off the device and back, byte for byte (the actor's sleep and wake).

Where the platform has no memory saver (relax.platform: CPU today), the actor's device storages are
copied to host memory and then shrunk to zero bytes, which returns their memory to the allocator; wake
grows each storage back to its size and copies the bytes in. Working on storages, not tensors, keeps
every view valid: Megatron's parameters and main_grads are views into DDP's flat buffers, and the
optimizer holds its own views. Nothing is re-created, so every reference anybody holds stays good.
"""

from collections.abc import Iterable

import torch


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostCopies:
    """The distinct storages of some tensors, released to host memory on `release`, back on `restore`."""

    def __init__(self, tensors: Iterable[torch.Tensor], device_type: str):
        self._storages: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.device.type == device_type and storage.nbytes() > 0:
                self._storages.setdefault(storage.data_ptr(), storage)
        self._host: dict[int, torch.Tensor] | None = None

    @property
    def released(self) -> bool:
        return self._host is not None

    @property
    def nbytes(self) -> int:
        """Bytes these storages hold on the device now (0 while released)."""
        return sum(storage.nbytes() for storage in self._storages.values())

    def release(self) -> None:
        if self.released:
            raise RuntimeError("already released: restore() first")
        device = next(iter(self._storages.values())).device if self._storages else torch.device("cpu")
        # On an accelerator: one asynchronous copy per storage straight into pinned host memory (torch's
        # caching host allocator keeps the pinned blocks for the next sleep), then one synchronize before
        # any storage shrinks. Copying to pageable memory and pinning that afterwards moved 17 GB in 13 s
        # on an H200; this path is bound by the host link (docs/benchmarks.md).
        pin = device.type != "cpu"
        self._host = {}
        for key, storage in self._storages.items():
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_byte_view(storage), non_blocking=pin)
            self._host[key] = host
        _synchronize(device)
        for storage in self._storages.values():
            storage.resize_(0)

    def restore(self) -> None:
        if not self.released:
            raise RuntimeError("not released: release() first")
        device = next(iter(self._storages.values())).device if self._storages else torch.device("cpu")
        for key, storage in self._storages.items():
            host = self._host[key]
            storage.resize_(host.numel())
            _byte_view(storage).copy_(host, non_blocking=device.type != "cpu")
        _synchronize(device)  # the host buffers go back to the allocator only after their copies are done
        self._host = None


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)
