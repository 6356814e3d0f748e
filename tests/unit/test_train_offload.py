"""relax.train.offload: which route a platform gets, and each route's own logic on the CPU. The memory
saver route runs here against a test double that records the calls torch_memory_saver would get; the real
saver is exercised on a GPU by tests/gpu/test_train_actor_gpu.py."""

import contextlib
import sys
import types

import pytest
import torch

from relax.platform import get_platform
from relax.train.offload import ACTOR_TAG, HostCopies, SaverRegion, training_memory


class RecordingSaver:
    """Test double for torch_memory_saver's singleton: records regions entered, pauses and resumes."""

    def __init__(self):
        self.calls = []
        self.inside = False

    @contextlib.contextmanager
    def region(self, tag, enable_cpu_backup=False):
        self.calls.append(("region", tag, enable_cpu_backup))
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def pause(self, tag=None):
        self.calls.append(("pause", tag))

    def resume(self, tag=None):
        self.calls.append(("resume", tag))


class RecordingDeviceModule:
    def __init__(self, saver):
        self.saver, self.calls = saver, []

    def synchronize(self, device=None):
        self.calls.append("synchronize")
        self.saver.calls.append(("synchronize",))

    def empty_cache(self):
        self.calls.append("empty_cache")
        self.saver.calls.append(("empty_cache",))


def _platform(has_memory_saver: bool, saver=None):
    return types.SimpleNamespace(
        has_memory_saver=has_memory_saver,
        load_memory_saver=lambda: saver,
        device_module=RecordingDeviceModule(saver or RecordingSaver()),
        device_type="cpu",
    )


def test_the_route_follows_the_platform_record_and_the_setting():
    saver = RecordingSaver()
    tensors = lambda: []  # noqa: E731
    assert isinstance(training_memory(_platform(True, saver), tensors), SaverRegion)
    assert isinstance(training_memory(_platform(True, saver), tensors, use_memory_saver=False), HostCopies)
    assert isinstance(training_memory(_platform(False), tensors), HostCopies)
    # The CPU record has no memory saver: host copies, whatever the setting.
    assert isinstance(training_memory(get_platform("cpu"), tensors), HostCopies)


def _region(state):
    saver = RecordingSaver()
    platform = _platform(True, saver)
    return saver, training_memory(platform, lambda: state)


def test_saver_region_allocates_with_a_host_backup_and_pauses_after_emptying_the_cache():
    state = [torch.arange(6.0)]
    saver, region = _region(state)
    with region.allocating():
        assert saver.inside
    assert saver.calls == [("region", ACTOR_TAG, True)]
    saver.calls.clear()
    assert region.nbytes == 24 and not region.released
    region.release()
    # Kernels finish, the default pool's free blocks go back, then the region is paused.
    assert saver.calls == [("synchronize",), ("empty_cache",), ("pause", ACTOR_TAG)]
    assert region.released and region.nbytes == 0
    with pytest.raises(RuntimeError, match="already released"):
        region.release()
    region.restore()
    assert saver.calls[-1] == ("resume", ACTOR_TAG) and not region.released and region.nbytes == 24
    with pytest.raises(RuntimeError, match="not released"):
        region.restore()


def test_adopt_copies_a_tensor_into_the_region_once():
    saver, region = _region([])
    made_outside = torch.arange(4.0)
    adopted = region.adopt(made_outside)
    assert adopted is not made_outside and torch.equal(adopted, made_outside)
    assert adopted.untyped_storage().data_ptr() != made_outside.untyped_storage().data_ptr()
    assert saver.calls == [("region", ACTOR_TAG, True)]  # the copy was made inside the region
    assert region.adopt(adopted) is adopted  # already there: no second copy
    meta = torch.empty(3, device="meta")  # not on the platform's device: nothing to release
    assert region.adopt(meta) is meta
    assert len(saver.calls) == 1


def test_host_copies_release_every_storage_once_and_restore_it_bit_for_bit():
    flat = torch.randn(10)
    views = [flat[:4], flat[4:]]  # two views of one storage (a DDP buffer and its parameters)
    state = [*views, flat]
    module = RecordingDeviceModule(RecordingSaver())
    copies = HostCopies(lambda: state, module, "cpu")
    expected = flat.clone()
    assert copies.allocating().__enter__() is None and copies.adopt(flat) is flat
    assert copies.nbytes == 40
    copies.release()
    assert flat.untyped_storage().nbytes() == 0 and copies.nbytes == 0 and copies.released
    assert module.calls == ["synchronize", "empty_cache"]
    with pytest.raises(RuntimeError, match="already released"):
        copies.release()
    copies.restore()
    assert torch.equal(flat, expected) and torch.equal(views[1], expected[4:]) and not copies.released
    with pytest.raises(RuntimeError, match="not released"):
        copies.restore()


def test_host_copies_take_the_state_as_it_is_at_release():
    state = [torch.ones(2)]
    copies = HostCopies(lambda: state, RecordingDeviceModule(RecordingSaver()), "cpu")
    state.append(torch.full((3,), 7.0))  # e.g. Adam's moments, made at the first step
    copies.release()
    assert all(t.untyped_storage().nbytes() == 0 for t in state)
    copies.restore()
    assert torch.equal(state[1], torch.full((3,), 7.0))


def test_the_cuda_saver_is_set_up_once_per_process(monkeypatch):
    """torch_memory_saver takes its hook mode only before its first use; every actor of a process gets the
    one singleton, set to the torch hook mode (stand-in module: torch_memory_saver needs a GPU)."""
    from relax.platform import cuda

    class Singleton:
        def __init__(self):
            self.hook_modes = []

        @property
        def hook_mode(self):
            raise AttributeError

        @hook_mode.setter
        def hook_mode(self, mode):
            if self.hook_modes:
                raise AttributeError("_impl_ctor_kwargs")  # what the real one raises once initialised
            self.hook_modes.append(mode)

    module = types.SimpleNamespace(torch_memory_saver=Singleton())
    monkeypatch.setitem(sys.modules, "torch_memory_saver", module)
    cuda.load_torch_memory_saver.cache_clear()
    try:
        first, second = (cuda.CudaPlatform().load_memory_saver() for _ in range(2))
    finally:
        cuda.load_torch_memory_saver.cache_clear()
    assert first is second is module.torch_memory_saver and first.hook_modes == ["torch"]
