"""CPU: debugging and CI. Real SGLang and real megatron-core run here, on gloo, with no device memory.

Verified on this CPU stack (torch 2.13.0+cpu, megatron-core 0.16.1, sglang 0.5.23) by
tests/e2e/test_platform_megatron.py and tests/e2e/test_platform_sglang.py.
"""

from contextlib import contextmanager

import torch

from relax.platform import Platform, TritonLaunch, frozen, grouped_linear, refuse_feature_args


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


class NoMemorySaver:
    """Stands in for torch_memory_saver where memory is never handed back: every call does nothing."""

    enabled = False

    @staticmethod
    @contextmanager
    def region(tag: str, enable_cpu_backup: bool = False):
        yield

    @staticmethod
    def pause(tag: str = None) -> None:
        pass

    @staticmethod
    def resume(tag: str = None) -> None:
        pass


def _as_cpu_index_device(device) -> torch.device:
    if isinstance(device, int):
        return torch.device("cpu", device)
    device = torch.device(device)
    return torch.device("cpu", device.index or 0) if device.type == "cpu" else device


def _worker_env(memory_saver_on: bool) -> dict:
    # Nothing is needed: Ray already sets OMP_NUM_THREADS=1 in actors, and gloo needs no tuning.
    return {}


def _check_worker_env(env, memory_saver_on: bool) -> None:
    """Any environment works on the CPU."""


def _prepare_megatron(feature_args) -> None:
    refuse_feature_args("cpu", feature_args)
    from relax.platform.cpu_megatron import prepare_megatron

    prepare_megatron()


def _prepare_sglang() -> None:
    from relax.platform.cpu_sglang import prepare_sglang

    prepare_sglang()


# ServerArgs overrides that make SGLang 0.5.23's engine run on a CPU (docs/upstream-facts.md).
SGLANG_SERVER_DEFAULTS = {
    "device": "cpu",
    "attention_backend": "torch_native",  # the only attention backend with a CPU path without sgl-kernel
    "disable_cuda_graph": True,
    "skip_server_warmup": True,
    # SGLang sizes its pools from the host's free memory, measured before and after loading the weights: the
    # pools get what is left of mem_fraction_static x (free memory before), and a start fails ("Loaded weights
    # leave no GPU memory", "Not enough GPU memory for hybrid ... state cache") when other processes took more
    # than that meanwhile (a second engine, a training rank, parallel jobs). At 0.05 that margin (about 1 GB)
    # was seen to run out; 0.25 leaves several GB, and the two caps below keep the pools small (SGLang's
    # default fraction, 0.719, made a 14 GB KV cache and a 51 s start).
    "mem_fraction_static": 0.25,
    "max_total_tokens": 65536,
    "max_mamba_cache_size": 512,  # Qwen3.5 / Qwen3-Next state slots (about 3 per running request)
    # With "auto", one prompt of a batch diverged from HF's greedy tokens; float32 matches exactly.
    "dtype": "float32",
    # Hybrid GDN / mamba models (Qwen3.5, Qwen3-Next): SGLang 0.5.23 picks the radix cache's "extra_buffer"
    # strategy when the overlap schedule is on, and that strategy asserts platform support the CPU lacks
    # (arg_groups/mamba_hook.py). "no_buffer" needs the overlap schedule off. The strategy is ignored by other
    # models; the overlap schedule goes off for every model on the CPU (it overlaps host scheduling with device
    # work, and here both are the same cores).
    "mamba_radix_cache_strategy": "no_buffer",
    "disable_overlap_schedule": True,
}

def _triton_launch(device_index: int) -> TritonLaunch:
    """Under TRITON_INTERPRET=1 programs run one after another on the host, so the numbers only choose which code
    paths run: a few programs looping over work items, 8-row tiles, and key-head groups split up to 4 rows of the
    tiny test models (2 key heads of 2 value heads), so CPU tests, SGLang's engine with the tiny Qwen3.5 and its
    3-row decode batches included, go through both of gdn_decode's work splits."""
    import triton

    if not triton.knobs.runtime.interpret:
        raise RuntimeError(
            "Triton has no CPU backend: on the CPU its kernels run only interpreted (TRITON_INTERPRET=1, set before "
            "the kernels are imported; slow, for tests and debugging)"
        )
    return TritonLaunch(num_programs=4, decode_block_v=8, decode_split_items=16, decode_split_min_block_v=4,
                        decode_split_options=frozen({"num_stages": 2}))


PLATFORM = Platform(
    name="cpu",
    dist_backend="gloo",
    visible_devices_env=None,
    ray_resource=None,
    memory_saver=None,
    colocation_needs_release=False,  # the engine and the trainer share host memory
    # torch's shared-memory handles both fail between Ray actors: file_descriptor on multiprocessing's
    # authkey ("AuthenticationError: digest sent was rejected", which crashes SGLang's scheduler), and
    # file_system when its torch_shm_manager does not answer in time under load ("Shared memory manager
    # connection has timed out"). Copying the bytes costs little at the model sizes a CPU runs.
    same_node_transport="inline",
    # Inline payloads could reach any engine rank of the node; the CPU takes the per-device route anyway, so
    # that the route NPUs need (each engine rank fed by the training rank on its own bundle) runs in every CPU
    # test of the loop.
    handles_cross_devices=False,
    sglang_server_defaults=frozen(SGLANG_SERVER_DEFAULTS),
    attention_kernel="sdpa",
    gdn_training_kernel="reference",
    megatron_features=(),
    _load_device_module=lambda: CpuDeviceModule,
    _unavailable_reason=lambda: None,
    _worker_env=_worker_env,
    _check_worker_env=_check_worker_env,
    _load_memory_saver=lambda: NoMemorySaver,
    _prepare_megatron=_prepare_megatron,
    _prepare_sglang=_prepare_sglang,
    _triton_launch=_triton_launch,
    _grouped_linear=grouped_linear.looped_grouped_linear,
)
