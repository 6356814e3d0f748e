"""NVIDIA GPUs: NCCL, CUDA_VISIBLE_DEVICES, Ray "GPU" bundles, torch_memory_saver, CUDA IPC handles.

Megatron and SGLang are CUDA-native, so nothing has to happen before they are imported.
The record's selection and environment logic is unit-tested on CPU (tests/unit/test_platform.py);
running on a GPU is exercised by tests/gpu only.
"""

import functools
import shutil
import subprocess
from typing import Optional

from relax import pins
from relax.platform.base import Platform, frozen, refuse_feature_args


@functools.cache  # the hook mode can be set only before the saver's first use: once per process
def load_torch_memory_saver():
    import torch_memory_saver

    saver = torch_memory_saver.torch_memory_saver
    # The default "preload" hook mode asserts unless the process was started with the library in
    # LD_PRELOAD; "torch" (a pluggable allocator) needs nothing at start. Measured on an H200
    # (torch 2.11, torch-memory-saver 0.0.10): pausing a 1 GiB region freed 1.00 GiB, resume took it back.
    saver.hook_mode = "torch"
    return saver


def nvidia_driver_version() -> Optional[str]:
    if not shutil.which("nvidia-smi"):
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource = "GPU"
    memory_saver = "torch_memory_saver"
    # Measured on an H200 (docs/benchmarks.md, the colocated step): a 1.4B actor's 21 GiB training state slept in
    # 1.6-2.4 s and woke in 0.6 s through pinned host copies, against 12-16 s and 3-4 s through torch_memory_saver
    # (0.0.10); a whole colocated step took 9-12 s against 23-26 s.
    actor_sleep_route = "host-copies"
    alloc_conf_env = "PYTORCH_CUDA_ALLOC_CONF"
    colocation_needs_release = True
    same_node_transport = "ipc"
    handles_cross_devices = True  # SGLang's receiver finds a CUDA IPC handle's device by its uuid
    sglang_server_defaults = frozen({"device": "cuda"})
    attention_kernel = "flash_varlen"
    context_parallel_attention = "all-gather"
    gdn_training_kernel = "relax"
    logprob_kernel = "triton"
    megatron_features = ()
    pinned_versions = frozen({"torch": pins.TORCH_CUDA, "torch-memory-saver": pins.TORCH_MEMORY_SAVER})
    patches_required = True
    toolkit = "NVIDIA driver"
    toolkit_pin = None
    triton_target = "nvidia"

    @property
    def device_module(self):
        import torch

        return torch.cuda

    def unavailable_reason(self) -> Optional[str]:
        import torch

        if torch.version.cuda is None:
            return f"torch {torch.__version__} is not a CUDA build"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device (check the driver and CUDA_VISIBLE_DEVICES)"
        return None

    def load_memory_saver(self):
        return load_torch_memory_saver()

    def worker_env(self, memory_saver_on: bool = False) -> dict:
        return {
            # Megatron schedules tensor-parallel communication (sequence parallelism, overlapped
            # all-gathers) assuming kernels reach the GPU in issue order: one hardware queue.
            "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        }

    def prepare_megatron(self, feature_args=None) -> None:
        refuse_feature_args(self.name, feature_args)  # megatron-core targets CUDA as it is

    def prepare_sglang(self) -> None:
        """SGLang targets CUDA as it is."""

    def grouped_linear(self, inputs, weights, tokens_per_group):
        from relax.platform.grouped_linear import cuda_grouped_linear

        return cuda_grouped_linear(inputs, weights, tokens_per_group)

    def toolkit_version(self, environ) -> Optional[str]:
        return nvidia_driver_version()

    def triton_compute_units(self, device_index: int) -> int:
        import triton

        return triton.runtime.driver.active.utils.get_device_properties(device_index)["multiprocessor_count"]
