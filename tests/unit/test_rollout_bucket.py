"""relax.sync.bucket: buckets by size, and SGLang's flattened-bucket payload round trip."""

import pytest
import torch

from relax.platform import get_platform
from relax.sync.bucket import bucket_specs, serialize_bucket, split_into_buckets


def test_split_into_buckets_by_bytes():
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 1])]
    buckets = list(split_into_buckets(tensors, bucket_bytes=80))  # 20 floats per bucket
    assert [[name for name, _ in bucket] for bucket in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    with pytest.raises(ValueError, match="bucket size must be positive"):
        list(split_into_buckets(tensors, 0))


def test_cpu_payload_carries_the_bytes_through_sglangs_unpickler():
    platform = get_platform("cpu")
    platform.prepare_sglang()  # before the first sglang import of the test session
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = [
        ("model.layers.0.mlp.up_proj.weight", torch.randn(4, 3)),
        ("model.norm.weight", torch.randn(3, dtype=torch.bfloat16)),
        ("transposed", torch.randn(3, 2).t()),  # not contiguous
    ]
    bucket, payloads = serialize_bucket(named, platform, tp_size=2)
    assert len(payloads) == 2
    received = MultiprocessingSerializer.deserialize(payloads[1])
    assert not received["flattened_tensor"].is_shared()  # a copy: no torch shared-memory manager involved
    # wider dtypes first, so every slice is aligned for its dtype
    assert [m.name for m in received["metadata"]] == [named[0][0], named[2][0], named[1][0]]
    assert bucket_specs(bucket) == [(named[0][0], (4, 3)), (named[2][0], (2, 3)), (named[1][0], (3,))]
    rebuilt = FlattenedTensorBucket(flattened_tensor=received["flattened_tensor"], metadata=received["metadata"])
    rebuilt_tensors = dict(rebuilt.reconstruct_tensors())
    for name, tensor in named:
        assert rebuilt_tensors[name].dtype == tensor.dtype and torch.equal(rebuilt_tensors[name], tensor)
    with pytest.raises(ValueError, match="empty weight bucket"):
        serialize_bucket([], platform)
