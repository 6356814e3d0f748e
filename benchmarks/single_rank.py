"""This process as the only rank of a process group, for the single-device benchmarks and GPU tests."""

import os
import socket

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
