"""Context parallelism (CP) for packed rows: each sequence of a micro-batch split over the CP ranks.

The split is the load-balanced head-tail one of Megatron-LM: every sequence of the row is padded to a multiple of
2 * CP tokens (relax.train.batch) and cut into 2 * CP equal chunks, and CP rank r holds chunks r and 2 * CP - 1 - r
of every sequence, in that order. Under causal attention an early chunk attends to few keys and a late one to many,
so every rank gets about the same work. megatron-core's rotary embedding over packed rows follows the same convention
(it reads the whole row's cu_seqlens and the CP group), so each local token is rotated by its position in its
sequence.

Attention (relax.train.model.core_attention): each rank all-gathers the keys and values of the whole row over the CP
group (the backward reduce-scatters their gradients), then its queries attend with the platform's varlen kernel:
each local chunk is a query sequence whose keys are its sequence's tokens up to the chunk's end, causality aligned to
the end (relax.platform.attention.packed_with_keys), so a query at position p of its sequence sees that sequence's
keys at positions <= p. The all-gather holds the whole row's keys and values on every rank; passing them around a
ring, or MindSpeed's own CP on Ascend, would not.

Loss (relax.train.actor): each rank computes the logprobs and entropies of its own tokens (the vocabulary-sized work),
then gathers them, one number per token, over the CP group into the whole row, so that every CP rank computes the
loss and the metrics of its whole sequences (sequence means, GSPO's sequence ratio, the aggregation's denominators
need every token of a sequence). The gather's backward hands each rank the gradient of its own tokens; the parameter
gradients of the CP ranks then add up to the whole row's, and megatron-core's DDP reduces them over the data-parallel
x context-parallel group.
"""

import dataclasses
import functools
import typing

import torch


class Refusal(typing.NamedTuple):
    """What context parallelism does not do yet: the actor refuses it, and relax.args.unsupported at parse time."""

    what: str
    applies: typing.Callable[[typing.Any], bool]  # whether a TransformerConfig has it
    reason: str


GATED_DELTA_NET = Refusal(
    "Gated DeltaNet layers (Qwen3.5, Qwen3-Next)",
    lambda config: config.experimental_attention_variant == "gated_delta_net",
    "a GDN layer's recurrence runs through each sequence in order, and passing its recurrent state from one CP rank's "
    "chunk to the next is not done yet (each rank would restart the state at its own chunks)",
)
REFUSED = [
    GATED_DELTA_NET,
    Refusal(
        "MoE layers",
        lambda config: bool(config.num_moe_experts),
        "composing context parallelism with expert parallelism and routing replay (whose experts are laid out per "
        "unpadded sample) is not done yet",
    ),
    Refusal(
        "pipeline parallelism",
        lambda config: config.pipeline_model_parallel_size > 1,
        "pipeline stages exchange activations of one planned shape, which is not yet planned for rows split over "
        "CP ranks",
    ),
]


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """One CP rank's part of a packed row and what attention needs to attend its queries to the whole row's keys.

    Every index tensor is into per-position tensors of the row (token_index) or of the CP ranks' tokens gathered in
    rank order (gathered_order, key_index)."""

    group: object  # the CP process group
    token_index: torch.Tensor  # [t / CP] the row positions of this rank's tokens, in its order
    gathered_order: torch.Tensor  # [t] for each row position, its place among the gathered tokens
    query_cu_seqlens: torch.Tensor  # int32: this rank's chunks, two per sequence, as query sequences
    key_cu_seqlens: torch.Tensor  # int32: each chunk's keys, its sequence from the start to the chunk's end
    max_query_len: int
    max_key_len: int
    key_index: torch.Tensor  # into the gathered keys: each chunk's keys, one chunk after another

    def local(self, per_position: torch.Tensor) -> torch.Tensor:
        """This rank's tokens [1, t / CP] of a per-position tensor of the row [1, t]."""
        return per_position[:, self.token_index]

    def whole_row(self, local: torch.Tensor) -> torch.Tensor:
        """Per-position values of the whole row [1, t], the same on every CP rank, from each rank's own [1, t / CP].
        The backward gives each rank its own tokens' part of the gradient: every CP rank computes the same function
        of the row."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        gathered = gather_from_sequence_parallel_region(local[0], tensor_parallel_output_grad=False, group=self.group)
        return gathered[self.gathered_order][None]

    def attention_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """The keys (or values) [t / CP, heads, d] of this rank's tokens become each local chunk's keys, gathered from
        the whole row; the backward reduce-scatters their gradients to the ranks whose tokens they are."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        gathered = gather_from_sequence_parallel_region(keys, tensor_parallel_output_grad=True, group=self.group)
        return gathered[self.key_index]


def _chunks(cu_seqlens: list[int], size: int, rank: int):
    """(sequence start, chunk length, chunk number) of the chunks rank `rank` of `size` holds, in its order."""
    for start, end in zip(cu_seqlens, cu_seqlens[1:]):
        if (end - start) % (2 * size):
            raise ValueError(
                f"a packed sequence of {end - start} tokens does not split into 2 x {size} equal chunks for context "
                f"parallelism: pack micro-batches with relax.train.batch's sequence_multiple={2 * size}"
            )
        chunk = (end - start) // (2 * size)
        for number in (rank, 2 * size - 1 - rank):
            yield start, chunk, number


def _cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def split_row(cu_seqlens: list[int], size: int, rank: int, group, device) -> RowSplit:
    """How rank `rank` of the `size` CP ranks holds a packed row of sequences bounded by `cu_seqlens` (each a multiple
    of 2 * size tokens long), its index tensors on `device`."""

    def token_index(of_rank: int) -> torch.Tensor:
        ranges = [torch.arange(start + number * chunk, start + (number + 1) * chunk) for start, chunk, number in
                  _chunks(cu_seqlens, size, of_rank)]
        return torch.cat(ranges)

    gathered_order = torch.cat([token_index(r) for r in range(size)]).argsort()
    chunks = list(_chunks(cu_seqlens, size, rank))
    key_lengths = [(number + 1) * chunk for _, chunk, number in chunks]
    key_rows = torch.cat([torch.arange(start, start + length) for (start, _, _), length in zip(chunks, key_lengths)])
    return RowSplit(
        group=group,
        token_index=token_index(rank).to(device),
        gathered_order=gathered_order.to(device),
        query_cu_seqlens=_cumulative([chunk for _, chunk, _ in chunks]).to(device),
        key_cu_seqlens=_cumulative(key_lengths).to(device),
        max_query_len=max(chunk for _, chunk, _ in chunks),
        max_key_len=max(key_lengths),
        key_index=gathered_order[key_rows].to(device),
    )


@functools.cache
def _split_packed_seq_params_class():
    """megatron-core's PackedSeqParams with the row's split: megatron hands the object as it is to every layer's core
    attention, in the forward and in a recomputed one. Made on first use: relax imports megatron only after the
    platform prepared it."""
    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclasses.dataclass
    class SplitPackedSeqParams(PackedSeqParams):
        row_split: RowSplit | None = None

    return SplitPackedSeqParams


def with_row_split(params, row_split: RowSplit):
    """megatron-core's PackedSeqParams of the whole row (what its rotary embedding reads under CP) carrying
    `row_split` for relax's core attention."""
    fields = {field.name: getattr(params, field.name) for field in dataclasses.fields(params)}
    return _split_packed_seq_params_class()(**fields, row_split=row_split)
