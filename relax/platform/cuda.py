"""NVIDIA GPUs: NCCL, CUDA_VISIBLE_DEVICES, Ray "GPU" bundles, torch_memory_saver, CUDA IPC handles.

Megatron and SGLang are CUDA-native, so nothing has to happen before they are imported.
The record's selection and environment logic is unit-tested on CPU (tests/unit/test_platform.py);
running on a GPU is exercised by tests/gpu only.
"""

import functools
from typing import Optional

from relax.platform import (
    Platform, TritonLaunch, alloc_conf_has_expandable_segments, frozen, grouped_linear, refuse_feature_args,
)

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


# Measured on an H200 (docs/benchmarks.md, "GDN decode (H200)"; 132 SMs): a grid of 16 programs per SM with 4
# warps and num_stages=2, which gdn_decode reads as "load each state tile one step ahead": 2-17% faster than
# without at batch 1 to 256 (80.1 against 82.3 us at batch 64), since the kernel fits that in 127 registers per
# thread (4 programs per SM). Other NVIDIA GPUs get the same numbers per SM: not measured on any GPU but the H200.
_PROGRAMS_PER_SM = 16
_OPTIONS = {"num_warps": 4, "num_stages": 2}
# gdn_decode's tile when one program does a key head's group: 32 rows measured 2-3% faster than 64 at batch 64
# and 256, and 16 rows slower.
_DECODE_BLOCK_V = 32
# Split a key head's group over programs while the work items fit 2 per SM, the fewest resident programs per SM
# measured. At Qwen3.5-9B's shape (16 key heads, 32 value heads, head dim 128) that splits batches 1 to 8 (16, 8,
# 4, 2 ways) and runs 16 up unsplit; benchmarks/gdn_decode.py --policy times every choice against the others.
_DECODE_SPLIT_ITEMS_PER_SM = 2
_DECODE_SPLIT_MIN_BLOCK_V = 16  # the smallest tile measured (batch 1's fastest)


def launch_for_sms(sms: int) -> TritonLaunch:
    """The launch record of a GPU with `sms` multiprocessors (the H200 has 132)."""
    return TritonLaunch(
        num_programs=sms * _PROGRAMS_PER_SM, options=frozen(_OPTIONS), decode_block_v=_DECODE_BLOCK_V,
        decode_split_items=sms * _DECODE_SPLIT_ITEMS_PER_SM, decode_split_min_block_v=_DECODE_SPLIT_MIN_BLOCK_V,
    )


def _triton_launch(device_index: int) -> TritonLaunch:
    import triton

    properties = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return launch_for_sms(properties["multiprocessor_count"])


PLATFORM = Platform(
    name="cuda",
    dist_backend="nccl",
    visible_devices_env="CUDA_VISIBLE_DEVICES",
    ray_resource="GPU",
    memory_saver="torch_memory_saver",
    colocation_needs_release=True,
    same_node_transport="ipc",
    handles_cross_devices=True,  # SGLang's receiver finds a CUDA IPC handle's device by its uuid
    sglang_server_defaults=frozen({"device": "cuda"}),
    attention_kernel="flash_varlen",
    gdn_training_kernel="fla",
    megatron_features=(),
    _load_device_module=_device_module,
    _unavailable_reason=_unavailable_reason,
    _worker_env=_worker_env,
    _check_worker_env=_check_worker_env,
    _load_memory_saver=_load_memory_saver,
    _prepare_megatron=_prepare_megatron,
    _prepare_sglang=_prepare_sglang,
    _triton_launch=_triton_launch,
    _grouped_linear=grouped_linear.cuda_grouped_linear,
)
