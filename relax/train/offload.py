"""Handing the actor's device memory back and taking it again, byte for byte (the actor's sleep and wake).

Two routes behind one small interface (`training_memory` picks one from the platform record):

- SaverRegion, where the platform has a memory saver (torch_memory_saver on CUDA and NPU): the training
  state is allocated inside one tagged region of the saver; release pauses the region (the saver copies its
  bytes to host memory and unmaps the device memory), restore maps it again at the same addresses and copies
  the bytes back. Nothing is copied or re-created by relax, so every view and reference stays good.
- HostCopies, where there is none (the CPU): the device storages are copied to host memory and shrunk to
  zero bytes; restore grows each back and copies the bytes in. Working on storages, not tensors, keeps every
  view valid: Megatron's parameters and main_grads are views into DDP's flat buffers, and the optimizer
  holds its own views.

The caller (relax.train.actor) builds what must be released inside `allocating()`, hands tensors made
outside it (Adam's moments, created at the first step or by a checkpoint load) to `adopt` before each
release, and then calls `release` / `restore`. Only what stays should be made inside the region: torch
never hands the free blocks of a memory pool still in use back to the device (empty_cache skips them), so
a temporary freed inside the region would be paused and copied with the state at every sleep.
"""

import contextlib
from collections.abc import Callable, Iterable

import torch

Tensors = Callable[[], Iterable[torch.Tensor]]

# The saver's tag for the actor's region (SGLang's engine uses its own tags in its own processes).
ACTOR_TAG = "relax_actor"


def training_memory(platform, tensors: Tensors, use_memory_saver: bool = True) -> "SaverRegion | HostCopies":
    """The platform's route for the training state `tensors()`: its memory saver where it has one (and
    `use_memory_saver`), host copies otherwise."""
    if use_memory_saver and platform.has_memory_saver:
        return SaverRegion(platform.load_memory_saver(), tensors, platform.device_module, platform.device_type)
    return HostCopies(tensors, platform.device_module, platform.device_type)


def _distinct_storages(tensors: Iterable[torch.Tensor], device_type: str) -> dict[int, torch.UntypedStorage]:
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.device.type == device_type and storage.nbytes() > 0:
            storages.setdefault(storage.data_ptr(), storage)
    return storages


class SaverRegion:
    """The training state in one region of the platform's memory saver, paused on release (with a host
    backup of its bytes) and resumed on restore."""

    def __init__(self, saver, tensors: Tensors, device_module, device_type: str, tag: str = ACTOR_TAG):
        self._saver = saver
        self._tensors = tensors
        self._device_module = device_module
        self._device_type = device_type
        self._tag = tag
        self._adopted: set[int] = set()  # data_ptr of the storages `adopt` made inside the region
        self.released = False

    @property
    def nbytes(self) -> int:
        """Bytes the training state holds on the device now (0 while released)."""
        if self.released:
            return 0
        return sum(storage.nbytes() for storage in _distinct_storages(self._tensors(), self._device_type).values())

    @contextlib.contextmanager
    def allocating(self):
        """Device tensors made in this block live in the region: released and restored with it."""
        with self._saver.region(tag=self._tag, enable_cpu_backup=True):
            yield

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` if it lives in the region already (made by `adopt`) or not on the device; else a copy made
        inside the region. The caller puts the copy where the tensor was; the original's memory goes back to
        the default pool, which releasing empties."""
        if tensor.device.type != self._device_type or tensor.untyped_storage().data_ptr() in self._adopted:
            return tensor
        with self.allocating():
            copy = tensor.clone()
        self._adopted.add(copy.untyped_storage().data_ptr())
        return copy

    def release(self) -> None:
        if self.released:
            raise RuntimeError("already released: restore() first")
        self._device_module.synchronize()  # no kernel may still use the region when it is unmapped
        self._device_module.empty_cache()  # activations and other freed blocks of the default pool
        self._saver.pause(self._tag)
        self.released = True

    def restore(self) -> None:
        if not self.released:
            raise RuntimeError("not released: release() first")
        self._saver.resume(self._tag)
        self.released = False


class HostCopies:
    """The distinct device storages of the training state, copied to host memory and shrunk to zero bytes
    on release, grown back and copied in on restore."""

    def __init__(self, tensors: Tensors, device_module, device_type: str):
        self._tensors = tensors
        self._device_module = device_module
        self._device_type = device_type
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._host: dict[int, torch.Tensor] | None = None

    @property
    def released(self) -> bool:
        return self._host is not None

    @property
    def nbytes(self) -> int:
        """Bytes the training state holds on the device now (0 while released: every storage is empty)."""
        return sum(storage.nbytes() for storage in _distinct_storages(self._tensors(), self._device_type).values())

    def allocating(self):
        """Nothing to set up: any storage can be copied out and back."""
        return contextlib.nullcontext()

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """Any storage can be copied out and back: the tensor itself."""
        return tensor

    def release(self) -> None:
        if self.released:
            raise RuntimeError("already released: restore() first")
        self._storages = _distinct_storages(self._tensors(), self._device_type)
        # On an accelerator: one asynchronous copy per storage straight into pinned host memory (torch's
        # caching host allocator keeps the pinned blocks for the next sleep), then one synchronize before
        # any storage shrinks. Copying to pageable memory and pinning that afterwards moved 17 GB in 13 s
        # on an H200; this path is bound by the host link (docs/benchmarks.md).
        pin = self._device_type != "cpu"
        host = {}
        for key, storage in self._storages.items():
            host[key] = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host[key].copy_(_byte_view(storage), non_blocking=pin)
        self._device_module.synchronize()
        for storage in self._storages.values():
            storage.resize_(0)
        self._host = host
        self._device_module.empty_cache()  # from the caching allocator back to the device

    def restore(self) -> None:
        if not self.released:
            raise RuntimeError("not released: release() first")
        pin = self._device_type != "cpu"
        for key, storage in self._storages.items():
            host = self._host[key]
            storage.resize_(host.numel())
            _byte_view(storage).copy_(host, non_blocking=pin)
        self._device_module.synchronize()  # the host buffers go back to the allocator only after their copies
        self._host = None
        self._storages = {}


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
