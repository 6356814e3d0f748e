"""Flattened weight buckets in SGLang's own format, ready for Engine.update_weights_from_tensor.

A bucket is a list of (HF name, tensor) packed by sglang.srt.weight_sync.tensor_bucket's
FlattenedTensorBucket into one uint8 tensor plus per-tensor metadata, then serialized with SGLang's
MultiprocessingSerializer: on accelerators the payload holds an IPC handle to the data, not the data;
on CPU it holds the bytes (the platform's same_node_transport says why). The engine loads it with
load_format="flattened_bucket".

The sender must keep the bucket's tensor alive until the engine has answered the update call (a
handle points into it); Engine.update_weights_from_tensor only returns after the engine has copied it.

Engines on other nodes get the same flattened tensor by broadcast instead (relax.sync.broadcast): they
allocate it from bucket_specs and bucket_dtypes, so both ends must pack in flatten_bucket's order.
"""

import pickle
from typing import Iterable, Iterator

import torch

LOAD_FORMAT = "flattened_bucket"


def split_into_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of named tensors of at most bucket_bytes each (a larger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    bucket, size = [], 0
    for name, tensor in named_tensors:
        tensor_bytes = tensor.numel() * tensor.element_size()
        if bucket and size + tensor_bytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor_bytes
    if bucket:
        yield bucket


def flatten_bucket(named_tensors: list[tuple[str, torch.Tensor]]):
    """SGLang's FlattenedTensorBucket of the named tensors (sglang must be importable: the platform's
    prepare_sglang() has run), in the order both transports use."""
    if not named_tensors:
        raise ValueError("cannot serialize an empty weight bucket")
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    # SGLang packs tensors back to back and views each slice as its dtype, which needs the slice's byte
    # offset to be a multiple of the dtype's size. Packing wider dtypes first guarantees that (sizes are
    # powers of two); the engine does not care about the order.
    ordered = sorted(named_tensors, key=lambda item: -item[1].element_size())
    return FlattenedTensorBucket(named_tensors=[(name, tensor.detach()) for name, tensor in ordered])


def serialize_bucket(named_tensors: list[tuple[str, torch.Tensor]], platform, tp_size: int = 1):
    """The flattened bucket and its per-TP-rank payloads for
    engine.update_weights_from_tensor(payloads, load_format=LOAD_FORMAT), made the way `platform`
    (a relax.platform record) hands tensors to an engine on the same node.

    Returns (bucket, payloads): keep `bucket` referenced until the update call has returned.
    """
    platform.prepare_sglang()
    bucket = flatten_bucket(named_tensors)
    return bucket, serialize_flattened(bucket, platform, tp_size)


def serialize_flattened(bucket, platform, tp_size: int = 1) -> list[bytes]:
    """Per-TP-rank payloads of a bucket from flatten_bucket (see serialize_bucket)."""
    platform.prepare_sglang()
    content = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    if platform.same_node_transport == "inline":
        # Plain pickle writes a CPU tensor's bytes into the payload (ForkingPickler would share it);
        # SGLang's receiving unpickler rebuilds it. Every rank can read the same payload.
        return [pickle.dumps(content, protocol=pickle.HIGHEST_PROTOCOL)] * tp_size
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    # SGLang's receiver finds the device of an IPC handle by UUID; its patched reductions write it.
    monkey_patch_torch_reductions()
    # One payload per rank: each rank deserializes only its own, so IPC reference counts stay per rank.
    return [MultiprocessingSerializer.serialize(content) for _ in range(tp_size)]


def bucket_specs(bucket) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in a bucket from flatten_bucket / serialize_bucket, in packing order:
    what the receiver checks."""
    return [(meta.name, tuple(meta.shape)) for meta in bucket.get_metadata()]


def bucket_dtypes(bucket) -> list[str]:
    """torch dtype names ("float32", "bfloat16") of a bucket's tensors, in packing order: with bucket_specs,
    all a receiver needs to allocate the bucket (SGLang's update_weights_from_distributed)."""
    return [str(meta.dtype).removeprefix("torch.") for meta in bucket.get_metadata()]
