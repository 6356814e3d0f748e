"""NVIDIA GPUs: NCCL, CUDA_VISIBLE_DEVICES, Ray "GPU" bundles, torch_memory_saver, CUDA IPC handles.

Megatron and SGLang are CUDA-native, so nothing has to happen before they are imported.
The record's selection and environment logic is unit-tested on CPU (tests/unit/test_platform.py);
running on a GPU is exercised by tests/gpu only.
"""

import functools
from typing import Optional

from relax.platform import Platform, alloc_conf_has_expandable_segments, frozen, refuse_feature_args

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def _unavailable_reason() -> Optional[str]:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (check the driver and CUDA_VISIBLE_DEVICES)"
    return None


def _worker_env(memory_saver_on: bool) -> dict:
    return {
        # Megatron schedules tensor-parallel communication (sequence parallelism, overlapped
        # all-gathers) assuming kernels reach the GPU in issue order: one hardware queue.
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }


def _check_worker_env(env, memory_saver_on: bool) -> None:
    # torch_memory_saver refuses to start beside expandable segments (it needs fixed allocations that it
    # can unmap and map again); fail before the workers start rather than inside them.
    if memory_saver_on and alloc_conf_has_expandable_segments(env.get(ALLOC_CONF_ENV, "")):
        raise ValueError(
            f"{ALLOC_CONF_ENV}={env[ALLOC_CONF_ENV]!r} turns on expandable segments, which torch_memory_saver "
            "cannot work with: drop expandable_segments from it, or turn the memory saver off"
        )


@functools.cache  # the hook mode can be set only before the saver's first use: once per process
def _load_memory_saver():
    import torch_memory_saver

    saver = torch_memory_saver.torch_memory_saver
    # The default "preload" hook mode asserts unless the process was started with the library in
    # LD_PRELOAD; "torch" (a pluggable allocator) needs nothing at start. Measured on an H200
    # (torch 2.11, torch-memory-saver 0.0.10): pausing a 1 GiB region freed 1.00 GiB, resume took it back.
    saver.hook_mode = "torch"
    return saver


def _prepare_megatron(feature_args) -> None:
    refuse_feature_args("cuda", feature_args)  # megatron-core targets CUDA as it is


def _prepare_sglang() -> None:
    """SGLang targets CUDA as it is."""


def _device_module():
    import torch

    return torch.cuda


# On an H200 (docs/benchmarks.md, "GDN decode (H200)"): a grid of 16 programs per SM, 4 warps; num_stages=1,
# i.e. gdn_decode loads each state tile when it updates it (loading one step ahead was no faster from batch 64 up).
_PROGRAMS_PER_SM = 16


def _triton_grid(device_index: int) -> tuple[int, dict]:
    import triton

    properties = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return properties["multiprocessor_count"] * _PROGRAMS_PER_SM, {"num_warps": 4, "num_stages": 1}


PLATFORM = Platform(
    name="cuda",
    dist_backend="nccl",
    visible_devices_env="CUDA_VISIBLE_DEVICES",
    ray_resource="GPU",
    memory_saver="torch_memory_saver",
    colocation_needs_release=True,
    same_node_transport="ipc",
    # NCCL tears communicators down asynchronously: groups created at once on the same GPUs can race with
    # the old ones' teardown. 3 s is a conservative pause, not a measured one.
    destroy_process_group_delay_s=3.0,
    sglang_server_defaults=frozen({"device": "cuda"}),
    _load_device_module=_device_module,
    _unavailable_reason=_unavailable_reason,
    _worker_env=_worker_env,
    _check_worker_env=_check_worker_env,
    _load_memory_saver=_load_memory_saver,
    _prepare_megatron=_prepare_megatron,
    _prepare_sglang=_prepare_sglang,
    _triton_grid=_triton_grid,
)
