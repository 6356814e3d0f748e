"""This process as the only rank of a process group, for the single-device benchmarks and GPU tests, and the
benchmarks' timing of a call."""

import os
import socket
import time

import torch


def init_distributed(device: str):
    """Prepare `device`'s platform (worker environment, Megatron), select device 0 and make a one-rank process group
    unless one exists; returns the platform record."""
    from relax.platform import get_platform

    platform = get_platform(device)
    os.environ.update(platform.worker_env())
    platform.prepare_megatron()
    if platform.device_type != "cpu":
        platform.set_device(0)
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group(
            platform.dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
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
