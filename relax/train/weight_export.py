"""The trained weights under HF names, in buckets of bounded size, ready for the engines.

    for bucket in weight_buckets(actor.model, actor.hf_checkpoint, bucket_bytes=512 << 20, dtype=torch.bfloat16):
        ...  # serialize_bucket(bucket, platform) and push it

One parameter is gathered across its TP (and EP) ranks at a time, converted to its HF tensors and added
to the bucket; the bucket is yielded as soon as the next tensor would overflow it. So beyond the model,
memory holds one bucket plus one gathered parameter, never a second copy of the model.

Collective: every rank of the actor iterates in step (the gathers are all-gathers). Every TP/EP rank of a
pipeline stage yields the same buckets; each PP stage yields its own layers. Tensors may share memory with
the model's parameters (a TP=1 weight is not copied unless `dtype` converts it): push a bucket before the
next optimizer step.
"""

from collections.abc import Iterator

import torch

from relax.hf_checkpoint import HFCheckpoint
from relax.sync.bucket import split_into_buckets
from relax.train.model import export_hf_weights


def weight_buckets(
    model, checkpoint: HFCheckpoint, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Lists of (HF name, tensor) of at most `bucket_bytes` each (a larger tensor travels alone), in `dtype`
    when given (the engine's dtype), else the model's."""
    named = export_hf_weights(model, checkpoint)
    if dtype is not None:
        named = ((name, tensor.to(dtype)) for name, tensor in named)
    return split_into_buckets(named, bucket_bytes)
