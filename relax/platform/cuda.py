"""NVIDIA GPUs: NCCL, CUDA_VISIBLE_DEVICES, Ray "GPU" bundles, torch_memory_saver, CUDA IPC handles.

Megatron and SGLang are CUDA-native, so nothing has to happen before they are imported.
The record's selection logic is tested on CPU (tests/unit/test_platform.py); running on a GPU is
exercised by tests/gpu only.
"""

from relax.platform import Platform, frozen


def is_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _worker_env(memory_saver_on: bool) -> dict:
    return {
        # Let NCCL errors surface as exceptions instead of hangs, and let the actor abort a stuck
        # collective when the engine or a peer dies (torch's name since 2.2).
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def _nothing_to_prepare() -> None:
    """megatron-core and SGLang target CUDA as they are."""


def build_platform() -> Platform:
    import torch

    if not is_available():
        raise RuntimeError(
            "device 'cuda' was asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
            "run on a GPU machine with a CUDA build of torch, or pass --device cpu"
        )
    return Platform(
        name="cuda",
        device_module=torch.cuda,
        dist_backend="nccl",
        visible_devices_env="CUDA_VISIBLE_DEVICES",
        ray_resource="GPU",
        memory_saver="torch_memory_saver",
        same_node_transport="ipc",
        sharing_strategy=None,
        # Tearing down NCCL communicators is asynchronous: new groups created at once on the same GPUs
        # can collide with the old ones' teardown (slime and verl sleep after destroy for this reason).
        destroy_process_group_delay_s=3.0,
        sglang_server_defaults=frozen({"device": "cuda"}),
        _worker_env=_worker_env,
        _prepare_megatron=_nothing_to_prepare,
        _prepare_sglang=_nothing_to_prepare,
    )
