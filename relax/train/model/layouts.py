"""How one Megatron parameter is made of HF tensors and cut across tensor-parallel ranks.

A family module maps each Megatron parameter name to a `Rule`: the HF tensor names it is made of and
the `kind` of the relation. The kinds are the only layout knowledge relax needs for the Qwen families:

- "replicated": one HF tensor, the same on every TP rank (norms, the MoE router).
- "column":     one HF tensor, TP ranks hold consecutive slices of dim 0 (vocab rows, output rows).
- "row":        one HF tensor, TP ranks hold consecutive slices of dim 1 (o_proj, down_proj).
- "qkv":        HF q, k, v (weights or biases) fused as Megatron's linear_qkv: per query group, that
                group's query heads then its key head then its value head; TP ranks hold whole groups.
- "gate_up":    HF gate and up fused as linear_fc1: each TP rank holds [its gate slice; its up slice].
"""

from dataclasses import dataclass

import torch

KINDS = ("replicated", "column", "row", "qkv", "gate_up")


@dataclass(frozen=True)
class Rule:
    kind: str
    hf_names: tuple[str, ...]

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown layout kind {self.kind!r}; choose one of {KINDS}")
        expected = {"qkv": 3, "gate_up": 2}.get(self.kind, 1)
        if len(self.hf_names) != expected:
            raise ValueError(f"a {self.kind!r} rule takes {expected} HF tensors, got {self.hf_names}")


@dataclass(frozen=True)
class AttentionLayout:
    """Head counts that the "qkv" kind needs."""

    num_heads: int
    num_query_groups: int
    head_dim: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups


def fuse(kind: str, hf_tensors: list[torch.Tensor], attention: AttentionLayout) -> torch.Tensor:
    """The whole (TP=1) Megatron tensor from its HF tensors."""
    if kind == "qkv":
        q, k, v = hf_tensors
        groups = attention.num_query_groups
        rest = q.shape[1:]  # (hidden,) for a weight, () for a bias
        per_group = [q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)
    if kind == "gate_up":
        return torch.cat(hf_tensors, dim=0)
    (tensor,) = hf_tensors
    return tensor


def unfuse(kind: str, megatron_tensor: torch.Tensor, attention: AttentionLayout) -> list[torch.Tensor]:
    """The HF tensors of a whole (TP=1) Megatron tensor; inverse of `fuse`."""
    if kind == "qkv":
        groups, head_dim = attention.num_query_groups, attention.head_dim
        rest = megatron_tensor.shape[1:]
        grouped = megatron_tensor.reshape(groups, -1, *rest)
        q, k, v = grouped.split([attention.heads_per_group * head_dim, head_dim, head_dim], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    if kind == "gate_up":
        return list(megatron_tensor.chunk(2, dim=0))
    return [megatron_tensor]


def tp_shard(kind: str, whole: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank `tp_rank`'s slice of a whole Megatron tensor."""
    if kind == "replicated" or tp_size == 1:
        return whole
    if kind == "row":
        return whole.chunk(tp_size, dim=1)[tp_rank]
    if kind == "gate_up":
        gate, up = whole.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    return whole.chunk(tp_size, dim=0)[tp_rank]  # column, qkv (whole query groups per rank)


def tp_unshard(kind: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole Megatron tensor from every TP rank's slice, in rank order; inverse of `tp_shard`."""
    if kind == "replicated" or len(shards) == 1:
        return shards[0]
    if kind == "row":
        return torch.cat(shards, dim=1)
    if kind == "gate_up":
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
    return torch.cat(shards, dim=0)
