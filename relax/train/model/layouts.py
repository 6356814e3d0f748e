"""How one Megatron parameter is made of HF tensors and cut across tensor-parallel ranks.

A family module maps each Megatron parameter name to a `Rule`: the HF tensor names it is made of and
the `kind` of the relation. The kinds are the only layout knowledge relax needs for the Qwen families:

- "replicated": one HF tensor, the same on every TP rank (norms, the MoE router).
- "column":     one HF tensor, TP ranks hold consecutive slices of dim 0 (vocab rows, output rows).
- "row":        one HF tensor, TP ranks hold consecutive slices of dim 1 (o_proj, down_proj).
- "qkv":        HF q, k, v (weights or biases) fused as Megatron's linear_qkv: per query group, that
                group's query heads then its key head then its value head; TP ranks hold whole groups.
- "gate_up":    HF gate and up fused as linear_fc1: each TP rank holds [its gate slice; its up slice].
- "gated_qkv":  like "qkv" with an attention output gate (Qwen3.5's full attention): HF q_proj holds per head
                [query | gate]; Megatron's linear_qkv holds per query group its query heads, then their gates,
                then its key head and its value head.
- Segments(sizes, groups): HF tensors concatenated along dim 0 whose pieces TP cuts one by one (GatedDeltaNet's
                in_proj [q | k | v | z | b | a] and conv1d [q | k | v]): `sizes` gives, per HF tensor, the dim-0
                sizes of its pieces; each TP rank holds its slice of every piece, in order. With groups > 1 each HF
                tensor repeats its pieces per group (Qwen3-Next's per-key-head in_proj_qkvz / in_proj_ba).
"""

from dataclasses import dataclass

import torch

KINDS = ("replicated", "column", "row", "qkv", "gate_up", "gated_qkv")


@dataclass(frozen=True)
class Segments:
    """The kind of a parameter made of dim-0 pieces of HF tensors that TP cuts one by one (see above).

    sizes: per HF tensor, the dim-0 sizes of its pieces. groups: how many times each HF tensor repeats its
    pieces (Qwen3-Next's in_proj_qkvz holds [q | k | v | z] per key head, so groups = key heads); Megatron holds
    every piece's groups together, pieces in order. groups=1 is plain concatenation."""

    sizes: tuple[tuple[int, ...], ...]
    groups: int = 1

    def pieces(self) -> list[int]:
        return [self.groups * size for hf_tensor in self.sizes for size in hf_tensor]

    def fuse(self, hf_tensors: list[torch.Tensor]) -> torch.Tensor:
        pieces = []
        for tensor, sizes in zip(hf_tensors, self.sizes):
            grouped = tensor.reshape(self.groups, sum(sizes), *tensor.shape[1:])
            pieces += [piece.reshape(-1, *tensor.shape[1:]) for piece in grouped.split(sizes, dim=1)]
        return torch.cat(pieces, dim=0)

    def unfuse(self, whole: torch.Tensor) -> list[torch.Tensor]:
        pieces = iter(whole.split(self.pieces(), dim=0))
        rest = whole.shape[1:]
        hf_tensors = []
        for sizes in self.sizes:
            grouped = [next(pieces).reshape(self.groups, size, *rest) for size in sizes]
            hf_tensors.append(torch.cat(grouped, dim=1).reshape(-1, *rest))
        return hf_tensors

    def tp_shard(self, whole: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        return torch.cat([piece.chunk(tp_size, dim=0)[tp_rank] for piece in whole.split(self.pieces(), dim=0)])

    def tp_unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        local = [size // len(shards) for size in self.pieces()]
        per_rank = [shard.split(local, dim=0) for shard in shards]
        return torch.cat([rank_pieces[i] for i in range(len(local)) for rank_pieces in per_rank])


@dataclass(frozen=True)
class Rule:
    kind: str | Segments
    hf_names: tuple[str, ...]

    def __post_init__(self):
        if isinstance(self.kind, Segments):
            if len(self.hf_names) != len(self.kind.sizes):
                raise ValueError(f"{self.kind} takes {len(self.kind.sizes)} HF tensors, got {self.hf_names}")
            return
        if self.kind not in KINDS:
            raise ValueError(f"unknown layout kind {self.kind!r}; choose one of {KINDS}")
        expected = {"qkv": 3, "gate_up": 2, "gated_qkv": 3}.get(self.kind, 1)
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
    if isinstance(kind, Segments):
        return kind.fuse(hf_tensors)
    if kind == "gated_qkv":
        q_and_gate, k, v = hf_tensors
        groups, head_dim = attention.num_query_groups, attention.head_dim
        rest = k.shape[1:]
        heads = q_and_gate.reshape(groups, attention.heads_per_group, 2, head_dim, *rest)
        query, gate = (heads[:, :, i].reshape(groups, -1, *rest) for i in (0, 1))
        return torch.cat([query, gate, k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], dim=1).reshape(
            -1, *rest
        )
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
    if isinstance(kind, Segments):
        return kind.unfuse(megatron_tensor)
    if kind == "gated_qkv":
        groups, head_dim, per_group = attention.num_query_groups, attention.head_dim, attention.heads_per_group
        rest = megatron_tensor.shape[1:]
        grouped = megatron_tensor.reshape(groups, -1, *rest)
        query, gate, k, v = grouped.split([per_group * head_dim, per_group * head_dim, head_dim, head_dim], dim=1)
        query, gate = (t.reshape(groups, per_group, 1, head_dim, *rest) for t in (query, gate))
        return [torch.cat([query, gate], dim=2).reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
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
    if isinstance(kind, Segments):
        return kind.tp_shard(whole, tp_rank, tp_size)
    if kind == "replicated" or tp_size == 1:
        return whole
    if kind == "row":
        return whole.chunk(tp_size, dim=1)[tp_rank]
    if kind == "gate_up":
        gate, up = whole.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    return whole.chunk(tp_size, dim=0)[tp_rank]  # column, qkv, gated_qkv (whole query groups per rank)


def tp_unshard(kind: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole Megatron tensor from every TP rank's slice, in rank order; inverse of `tp_shard`."""
    if isinstance(kind, Segments):
        return kind.tp_unshard(shards)
    if kind == "replicated" or len(shards) == 1:
        return shards[0]
    if kind == "row":
        return torch.cat(shards, dim=1)
    if kind == "gate_up":
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
    return torch.cat(shards, dim=0)
