"""Context parallelism (CP) for packed rows: each sequence of a micro-batch split over the CP ranks.

The split is the load-balanced head-tail one of Megatron-LM: every sequence of the row is padded to a multiple of
2 * CP tokens (relax.train.batch) and cut into 2 * CP equal chunks, and CP rank r holds chunks r and 2 * CP - 1 - r
of every sequence, in that order. Under causal attention an early chunk attends to few keys and a late one to many,
so every rank gets about the same work. megatron-core's rotary embedding over packed rows follows the same convention
(it reads the whole row's cu_seqlens and the CP group), so each local token is rotated by its position in its
sequence.

Attention (relax.train.model.core_attention), relax's all-gather: each rank all-gathers the keys and values of the
whole row over the CP group in one collective (the backward reduce-scatters their gradients), then its queries attend
with the platform's varlen kernel: each local chunk is a query sequence whose keys are its sequence's tokens up to the
chunk's end, causality aligned to the end (relax.platform.attention.packed_with_keys), so a query at position p of its
sequence sees that sequence's keys at positions <= p. The all-gather holds the whole row's keys and values on every
rank. On the NPU, MindSpeed's ring attention takes its place (relax.platform.attention.mindspeed_ring): its split of a
packed row over the CP ranks is this one, and the keys and values travel around the ring instead.

Loss (relax.train.actor): each rank computes the logprobs and entropies of its own tokens (the vocabulary-sized work),
then gathers them, one number per token, over the CP group into the whole row, so that every CP rank computes the
loss and the metrics of its whole sequences (sequence means, GSPO's sequence ratio, the aggregation's denominators
need every token of a sequence). The gather's backward hands each rank the gradient of its own tokens; the parameter
gradients of the CP ranks then add up to the whole row's, and megatron-core's DDP reduces them over the data-parallel
x context-parallel group.

Gated DeltaNet layers (RecurrenceSplit) pass state, never tokens of another rank's chunk to recompute. Their causal
convolution needs the width - 1 tokens before each chunk: every rank all-gathers the last width - 1 inputs of its
chunks. Their recurrence S_t = e^(g_t) (I - beta_t k_t k_t^T) S_(t-1) + beta_t k_t v_t^T is affine in the state, so a
chunk started from the state S_in ends at P S_in + S_own and outputs o_t = o_own,t + S_in^T P_t^T q_t, where P_t is the
product of the chunk's transitions through t and (o_own, S_own) are what the chunk computes from a zero state. One
call of the training kernel gives all of them: values widened by K zero columns and a starting state of [0 | I] (the
columns of a state evolve independently) make the extra columns' final state P and their output P_t^T q_t. The ranks
all-gather (S_own, P) of every chunk (a float32 [K, V + K] per head, whatever the chunk's length), each rank runs the
chunks' states in sequence order to its own chunks' S_in, and adds the correction. The kernel's work per token
doubles when K = V (Qwen3.5), and no rank recomputes another's chunk.
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


REFUSED = [
    Refusal(
        "MoE router losses (--moe-aux-loss-coeff, --moe-z-loss-coeff above 0)",
        lambda config: _router_losses(config),
        "megatron-core computes them over each CP rank's own tokens, and the router's gradient then differs from one "
        "rank's (checked on the CPU); RL recipes train MoE models with --moe-aux-loss-coeff 0",
    ),
]


def _gather(local: torch.Tensor, group) -> torch.Tensor:
    """The CP ranks' `local` [n, ...] concatenated in rank order; the backward sums each rank's part of the gradient
    from every rank (a reduce-scatter)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(local, tensor_parallel_output_grad=True, group=group)


def _router_losses(config) -> bool:
    aux = config.moe_aux_loss_coeff
    return any(coeff > 0 for coeff in (aux if isinstance(aux, list) else [aux])) or bool(config.moe_z_loss_coeff)


@dataclasses.dataclass(frozen=True)
class RecurrenceSplit:
    """What a Gated DeltaNet layer needs on one CP rank: the tokens before each of its chunks for the causal
    convolution, and where the chunks' states go in their sequences (the module docstring says how)."""

    group: object  # the CP process group
    chunk_cu_seqlens: torch.Tensor  # int32: this rank's chunks, two per sequence, as the kernel's sequences
    chunk_lengths: list[int]
    tail_index: torch.Tensor  # this rank's tokens that some chunk's convolution reads before its start
    extended_index: torch.Tensor  # into [local tokens, gathered tails, a zero row]: width - 1 rows, then each chunk
    extended_positions: torch.Tensor  # each extended row's position in its sequence (negative before the start)
    local_rows: torch.Tensor  # the extended rows that are this rank's tokens
    chunk_order: torch.Tensor  # [sequences, 2 * CP]: chunk n of sequence s among the ranks' chunks in rank order
    local_chunks: torch.Tensor  # this rank's chunks among the sequences' chunks, flattened sequence-major

    def with_preceding_tokens(self, local: torch.Tensor, gathered_tails: torch.Tensor):
        """(rows, their positions in their sequences): each of this rank's chunks [t / CP, d] preceded by the width - 1
        tokens before it (zero before a sequence's start), from the ranks' tails gathered in rank order."""
        zero = local.new_zeros(1, local.shape[-1])
        return torch.cat([local, gathered_tails, zero])[self.extended_index], self.extended_positions

    def causal_conv_inputs(self, local: torch.Tensor):
        """with_preceding_tokens over the CP group."""
        return self.with_preceding_tokens(local, _gather(local[self.tail_index], self.group))

    def chunk_states(self, chunk_rule, query, key, value, g, beta):
        """(outputs [1, t / CP, heads, V + K], final states [chunks, heads, K, V + K]) of this rank's chunks from the
        state [0 | I], with `chunk_rule` (fla's chunk_gated_delta_rule contract) on values widened by K zeros."""
        chunks, heads, key_dim = len(self.chunk_lengths), value.shape[2], key.shape[-1]
        widened = torch.cat([value, value.new_zeros(*value.shape[:-1], key_dim)], dim=-1)
        start = torch.zeros(chunks, heads, key_dim, value.shape[-1] + key_dim, device=value.device)
        start[..., value.shape[-1]:] = torch.eye(key_dim, device=value.device)
        return chunk_rule(
            query, key, widened, g=g, beta=beta, initial_state=start, output_final_state=True,
            use_qk_l2norm_in_kernel=False, cu_seqlens=self.chunk_cu_seqlens,
        )

    def with_incoming_states(self, outputs: torch.Tensor, gathered_states: torch.Tensor) -> torch.Tensor:
        """This rank's outputs [1, t / CP, heads, V] of the recurrence run through whole sequences, from its
        chunk_states outputs and every rank's final states gathered in rank order."""
        key_dim = gathered_states.shape[-2]
        value_dim = gathered_states.shape[-1] - key_dim
        own, transition = gathered_states[self.chunk_order].split([value_dim, key_dim], dim=-1)
        incoming = [torch.zeros_like(own[:, 0])]
        for number in range(own.shape[1] - 1):
            incoming.append(transition[:, number] @ incoming[-1] + own[:, number])
        incoming = torch.stack(incoming, dim=1).flatten(0, 1)[self.local_chunks]
        from_zero, through = outputs[0].split([value_dim, key_dim], dim=-1)
        corrections = [
            torch.einsum("thk,hkv->thv", rows.float(), state)
            for rows, state in zip(through.split(self.chunk_lengths), incoming)
        ]
        return (from_zero + torch.cat(corrections).to(from_zero.dtype))[None]

    def gated_delta_rule(self, chunk_rule, query, key, value, g, beta) -> torch.Tensor:
        """The gated delta rule's outputs [1, t / CP, heads, V] of this rank's tokens, each sequence run from a zero
        state through all its chunks: chunk_states, gathered over the CP group, with_incoming_states."""
        outputs, final = self.chunk_states(chunk_rule, query, key, value, g, beta)
        return self.with_incoming_states(outputs, _gather(final, self.group))


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
    recurrence: RecurrenceSplit | None = None  # for Gated DeltaNet layers

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

    def attention_keys_and_values(self, keys: torch.Tensor, values: torch.Tensor):
        """The keys and values [t / CP, heads, d] of this rank's tokens become each local chunk's keys and values,
        gathered from the whole row in one all-gather; the backward reduce-scatters their gradients to the ranks whose
        tokens they are."""
        gathered = _gather(torch.cat([keys, values], dim=-1), self.group)
        return tuple(part[self.key_index] for part in gathered.split([keys.shape[-1], values.shape[-1]], dim=-1))


def _recurrence_split(cu_seqlens: list[int], size: int, rank: int, group, conv_width: int, device) -> RecurrenceSplit:
    chunks_of = [list(_chunks(cu_seqlens, size, r)) for r in range(size)]
    # Each rank's tail: the last width - 1 tokens of each of its chunks (all of a shorter chunk), gathered in rank
    # order; tail_slot maps a row position to its place among the gathered tails.
    tail_rows, tail_slot = [], {}
    for chunks in chunks_of:
        local_row, rows = 0, []
        for start, chunk, number in chunks:
            tail = min(conv_width - 1, chunk)
            rows.extend(range(local_row + chunk - tail, local_row + chunk))
            end = start + (number + 1) * chunk
            first_slot = len(tail_slot)
            tail_slot.update((position, first_slot + i) for i, position in enumerate(range(end - tail, end)))
            local_row += chunk
        tail_rows.append(rows)
    local_tokens = sum(chunk for _, chunk, _ in chunks_of[rank])
    zero_row = local_tokens + len(tail_slot)
    extended_index, extended_positions, local_rows, local_row = [], [], [], 0
    for start, chunk, number in chunks_of[rank]:
        first = number * chunk  # the chunk's first position in its sequence
        for position in range(first - (conv_width - 1), first):
            extended_index.append(local_tokens + tail_slot[start + position] if position >= 0 else zero_row)
            extended_positions.append(position)
        local_rows.extend(range(len(extended_index), len(extended_index) + chunk))
        extended_index.extend(range(local_row, local_row + chunk))
        extended_positions.extend(range(first, first + chunk))
        local_row += chunk
    sequences = len(cu_seqlens) - 1
    per_rank = 2 * sequences
    chunk_order = torch.empty(sequences, 2 * size, dtype=torch.long)
    for r in range(size):
        chunk_order[:, r] = r * per_rank + 2 * torch.arange(sequences)
        chunk_order[:, 2 * size - 1 - r] = r * per_rank + 2 * torch.arange(sequences) + 1
    local_chunks = torch.tensor([s * 2 * size + n for s in range(sequences) for n in (rank, 2 * size - 1 - rank)])
    lengths = [chunk for _, chunk, _ in chunks_of[rank]]
    return RecurrenceSplit(
        group=group,
        chunk_cu_seqlens=_cumulative(lengths).to(device),
        chunk_lengths=lengths,
        tail_index=torch.tensor(tail_rows[rank], dtype=torch.long, device=device),
        extended_index=torch.tensor(extended_index, dtype=torch.long, device=device),
        extended_positions=torch.tensor(extended_positions, dtype=torch.long, device=device),
        local_rows=torch.tensor(local_rows, dtype=torch.long, device=device),
        chunk_order=chunk_order.to(device),
        local_chunks=local_chunks.to(device),
    )


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


def split_row(cu_seqlens: list[int], size: int, rank: int, group, device, conv_width: int | None = None) -> RowSplit:
    """How rank `rank` of the `size` CP ranks holds a packed row of sequences bounded by `cu_seqlens` (each a multiple
    of 2 * size tokens long), its index tensors on `device`. `conv_width`: the causal convolution's width of the
    model's Gated DeltaNet layers, if it has any."""

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
        recurrence=None if conv_width is None else _recurrence_split(cu_seqlens, size, rank, group, conv_width, device),
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
