"""This process as a rank of a process group (the only one, for the single-device benchmarks and GPU tests), and
the benchmarks' timing of a call."""

import os
import time

import torch

from relax.ports import free_port


def init_distributed(device: str, rank: int = 0, world_size: int = 1, port: int | None = None):
    """Prepare `device`'s platform (worker environment, Megatron), select device `rank` and make a process group of
    `world_size` ranks meeting at `port` (one rank: a free port) unless one exists; returns the platform record."""
    from relax.platform import get_platform

    platform = get_platform(device)
    os.environ.update(platform.worker_env())
    platform.prepare_megatron()
    if platform.device_type != "cpu":
        platform.set_device(rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            platform.dist_backend, init_method=f"tcp://127.0.0.1:{port or free_port()}", rank=rank,
            world_size=world_size,
        )
    return platform


def time_and_peak(run, platform, warmup: int, steps: int, prepare=tuple) -> tuple[float, int | None]:
    """(seconds per call of run(*prepare()), the peak device bytes allocated during a call beyond those allocated
    before it; None on the CPU): the mean of `steps` calls after `warmup` ones, prepare() made before each, untimed."""
    device = platform.device_module if platform.device_type != "cpu" else None
    for _ in range(warmup):
        run(*prepare())
    seconds, peak = 0.0, None
    for _ in range(steps):
        arguments = prepare()
        if device is not None:
            device.synchronize()
            device.reset_peak_memory_stats()
            before = device.memory_allocated()
        start = time.perf_counter()
        result = run(*arguments)
        if device is not None:
            device.synchronize()
            peak = max(peak or 0, device.max_memory_allocated() - before)
        seconds += time.perf_counter() - start
        del arguments, result  # before the next call's arguments are made
    return seconds / steps, peak
