"""CPU: debugging and CI. Real SGLang and real megatron-core run here, on gloo, with no device memory.

Verified on this CPU stack (torch 2.13.0+cpu, megatron-core 0.16.1, sglang 0.5.23) by
tests/e2e/test_platform_megatron.py, tests/e2e/test_engine.py and tests/e2e/test_qwen35_sglang.py.
"""

from contextlib import contextmanager
from typing import Optional

from relax import pins
from relax.platform.base import Platform, frozen, refuse_feature_args


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


# ServerArgs overrides that make SGLang 0.5.23's engine run on a CPU (docs/upstream-facts.md).
SGLANG_SERVER_DEFAULTS = {
    "device": "cpu",
    "attention_backend": "torch_native",  # the only attention backend with a CPU path without sgl-kernel
    "disable_cuda_graph": True,
    # Without it the scheduler's loop spins a core whenever it has no batch (while the actor trains, between the
    # tests of a module that keeps an engine), on cores the training ranks and other engines share; with it, the
    # loop waits on its input sockets, and a request wakes it.
    "sleep_on_idle": True,
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


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None
    ray_resource = None
    memory_saver = None
    # the only route: the CPU has no memory saver
    actor_sleep_route = "host-copies"
    alloc_conf_env = None
    colocation_needs_release = False  # the engine and the trainer share host memory
    # torch's shared-memory handles both fail between Ray actors: file_descriptor on multiprocessing's
    # authkey ("AuthenticationError: digest sent was rejected", which crashes SGLang's scheduler), and
    # file_system when its torch_shm_manager does not answer in time under load ("Shared memory manager
    # connection has timed out"). Copying the bytes costs little at the model sizes a CPU runs.
    same_node_transport = "inline"
    # Inline payloads could reach any engine rank of the node; the CPU takes the per-device route anyway, so
    # that the route NPUs need (each engine rank fed by the training rank on its own bundle) runs in every CPU
    # test of the loop.
    handles_cross_devices = False
    sglang_server_defaults = frozen(SGLANG_SERVER_DEFAULTS)
    attention_kernel = "sdpa"
    context_parallel_attention = "all-gather"
    gdn_training_kernel = "reference"
    logprob_kernel = "torch"  # Triton runs only interpreted on the host
    megatron_features = ()
    pinned_versions = frozen({"torch": pins.TORCH_CPU})
    # relax.platform redirects megatron-core's CUDA calls itself, and SGLang's patched paths (NPU backend, memory
    # release on a device) are not reached on the CPU.
    patches_required = False
    toolkit = None
    toolkit_pin = None
    triton_target = "interpreter"

    @property
    def device_module(self):
        from relax.platform.cpu_device import CpuDeviceModule

        return CpuDeviceModule

    def unavailable_reason(self) -> Optional[str]:
        return None

    def load_memory_saver(self):
        return NoMemorySaver

    def worker_env(self, memory_saver_on: bool = False) -> dict:
        if memory_saver_on:
            raise ValueError("platform 'cpu' has no memory saver; turn the memory saver off on this device")
        # Nothing is needed: Ray already sets OMP_NUM_THREADS=1 in actors, and gloo needs no tuning.
        return {}

    def prepare_megatron(self, feature_args=None) -> None:
        refuse_feature_args(self.name, feature_args)
        from relax.platform.cpu_megatron import prepare_megatron

        prepare_megatron()

    def prepare_sglang(self) -> None:
        from relax.platform.cpu_sglang import prepare_sglang

        prepare_sglang()

    def sglang_engine_processes(self):
        from relax.platform.cpu_sglang import engine_processes_from_a_forkserver

        return engine_processes_from_a_forkserver()

    def grouped_linear(self, inputs, weights, tokens_per_group):
        from relax.platform.grouped_linear import looped_grouped_linear

        return looped_grouped_linear(inputs, weights, tokens_per_group)

    def triton_compute_units(self, device_index: int) -> int:
        """Under TRITON_INTERPRET=1 programs run one after another on the host: one unit."""
        import triton

        if not triton.knobs.runtime.interpret:
            raise RuntimeError(
                "Triton has no CPU backend: on the CPU its kernels run only interpreted (TRITON_INTERPRET=1, set "
                "before the kernels are imported; slow, for tests and debugging)"
            )
        return 1
