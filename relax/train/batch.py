"""Rollout samples as the actor consumes them, how they are spread over data-parallel ranks, and how each rank's
share is cut into Megatron micro-batches.

A sample is one prompt + response token sequence; only response tokens are scored, and those its loss mask marks
(1; 0 for a token the policy did not sample, such as a tool's output) are trained. Per response token it may also
carry an advantage, the old policy's logprob, the reference policy's logprob and the rollout engine's logprob (what
the engine reported when it sampled the token). With routing replay (MoE models) it also
carries, per token of prompt + response but the last, the experts the engine's routers chose in each layer: the
actor's routers take those (relax.train.routing_replay). They are packed like the tokens; the rows a packed
micro-batch has no record for (each sequence's last token, which the engine never ran forward, and padding) hold
experts 0 .. top-k - 1: their outputs reach no logit that is read.

Data-parallel ranks: `balanced_shares` splits a batch into one share per rank with about equal token counts
(longest sample first onto the lightest rank), so the slowest rank is not the one that drew the long responses.

Micro-batches are packed rows (megatron-core's THD format): the samples of one micro-batch lie one after another
in a single row, `cu_seqlens` marks where each sequence starts, and attention and the GDN layers' state never
cross a boundary; each sequence's positions start at 0, so packing changes no logit. No attention mask exists:
a [rows, 1, s, s] mask costs s^2 memory per row and makes attention cost s^2 over the whole row instead of the sum
of each sequence's length^2. With a token budget (dynamic batch size) samples are packed, longest first, into as
few micro-batches as stay within the budget; without one, `micro_batch_size` consecutive samples make one.
Padding, where a fixed shape is needed, is one more sequence at the end of the row whose outputs are never read.
Under context parallelism every sequence is also padded at its end to a multiple of `sequence_multiple` tokens
(2 x the CP size: relax.train.context_parallel cuts each sequence into that many equal chunks); causality keeps a
sequence's padding out of its real tokens' outputs, and its outputs are never read.
"""

from dataclasses import dataclass, field

import torch

PER_TOKEN_FIELDS = ("loss_mask", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")


@dataclass
class RolloutBatch:
    """Samples for the actor. Lists are per sample; tensors are 1-D over response tokens."""

    tokens: list[torch.Tensor]  # prompt + response token ids
    response_lengths: list[int]
    # 1 where the loss trains the response token, 0 where not (relax.rollout.groups.Sample.loss_mask); None when
    # built: every response token is trained
    loss_mask: list[torch.Tensor] | None = None
    advantages: list[torch.Tensor] | None = None
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    rollout_logprobs: list[torch.Tensor] | None = None
    # Routing replay: per sample the engine's experts, integer [tokens - 1, layers, top-k] (see module doc)
    routed_experts: list[torch.Tensor] | None = None

    def __post_init__(self):
        self.tokens = [torch.as_tensor(t, dtype=torch.long) for t in self.tokens]
        if len(self.response_lengths) != len(self.tokens):
            raise ValueError(f"{len(self.response_lengths)} response lengths for {len(self.tokens)} samples")
        for i, (tokens, length) in enumerate(zip(self.tokens, self.response_lengths)):
            if tokens.dim() != 1 or not 1 <= length < tokens.numel():
                raise ValueError(
                    f"sample {i}: response length {length} must be >= 1 and leave at least one prompt token "
                    f"in its {tokens.numel()} tokens"
                )
        if self.loss_mask is None:
            self.loss_mask = [torch.ones(length) for length in self.response_lengths]
        for name in PER_TOKEN_FIELDS:
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != len(self.tokens):
                raise ValueError(f"{name}: {len(values)} entries for {len(self.tokens)} samples")
            values = [torch.as_tensor(v, dtype=torch.float32) for v in values]
            for i, (value, length) in enumerate(zip(values, self.response_lengths)):
                if value.shape != (length,):
                    raise ValueError(
                        f"{name}[{i}] has shape {tuple(value.shape)}, expected ({length},): one per response token"
                    )
            setattr(self, name, values)
        if self.routed_experts is not None:
            check_routed_experts(self.routed_experts, self.token_counts())

    def __len__(self):
        return len(self.tokens)

    def token_counts(self) -> list[int]:
        return [t.numel() for t in self.tokens]

    def select(self, indices) -> "RolloutBatch":
        """The samples at `indices`, in that order, with every per-token field they carry."""
        indices = list(indices)
        optional = {
            name: [getattr(self, name)[i] for i in indices]
            for name in PER_TOKEN_FIELDS
            if getattr(self, name) is not None
        }
        if self.routed_experts is not None:
            optional["routed_experts"] = [self.routed_experts[i] for i in indices]
        return RolloutBatch(
            tokens=[self.tokens[i] for i in indices],
            response_lengths=[self.response_lengths[i] for i in indices],
            **optional,
        )


def check_routed_experts(routed_experts: list[torch.Tensor | None], token_counts: list[int]) -> None:
    """Raise ValueError unless every sample (of `token_counts` tokens each) has its experts as [tokens - 1, layers,
    top-k], all of one [layers, top-k]."""
    if len(routed_experts) != len(token_counts):
        raise ValueError(f"routed_experts: {len(routed_experts)} entries for {len(token_counts)} samples")
    row = None
    for i, (experts, num_tokens) in enumerate(zip(routed_experts, token_counts)):
        if experts is None or experts.dim() != 3 or experts.shape[0] != num_tokens - 1:
            shape = None if experts is None else tuple(experts.shape)
            raise ValueError(
                f"routed_experts[{i}] has shape {shape}, expected ({num_tokens - 1}, layers, top-k): the "
                "experts of every token but the last"
            )
        if row is not None and tuple(experts.shape[1:]) != row:
            raise ValueError(f"routed_experts[{i}] has [layers, top-k] {tuple(experts.shape[1:])}, sample 0 {row}")
        row = tuple(experts.shape[1:])


def balanced_shares(token_counts: list[int], num_shares: int) -> list[list[int]]:
    """Sample indices for each of `num_shares` ranks, every rank at least one sample, token totals close: the
    longest samples first, each onto the share with the fewest tokens so far (ties: fewest samples, then lowest
    rank). Within a share, indices keep the batch's order."""
    if len(token_counts) < num_shares:
        raise ValueError(
            f"{len(token_counts)} samples cannot give each of {num_shares} data-parallel ranks one: raise the "
            "global batch size or lower the data-parallel size"
        )
    shares: list[list[int]] = [[] for _ in range(num_shares)]
    totals = [0] * num_shares
    for index in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        lightest = min(range(num_shares), key=lambda r: (totals[r], len(shares[r]), r))
        shares[lightest].append(index)
        totals[lightest] += token_counts[index]
    return [sorted(share) for share in shares]


def token_imbalance(token_counts: list[int], shares: list[list[int]]) -> float:
    """The largest share's tokens over the mean share's (1.0: perfectly even)."""
    totals = [sum(token_counts[i] for i in share) for share in shares]
    return max(totals) / (sum(totals) / len(totals))


@dataclass
class RankShare:
    """One data-parallel rank's part of a rollout: its samples, optimizer step after optimizer step."""

    indices: list[int] = field(default_factory=list)  # into the rollout
    step_sizes: list[int] = field(default_factory=list)  # how many of them each optimizer step trains on


def optimizer_step_sizes(num_samples: int, num_groups: int, samples_per_prompt: int, global_batch_size: int
                         ) -> list[int]:
    """How many of a rollout's `num_samples` samples (its `num_groups` groups') each optimizer step trains on:
    global_batch_size each where every group holds samples_per_prompt. Where a custom generate function's fan-out
    made groups larger, the rollout still takes num_groups x samples_per_prompt / global_batch_size steps (the LR
    schedule counts them), its samples spread over them in order, step sizes at most one apart."""
    nominal = num_groups * samples_per_prompt
    if nominal % global_batch_size:
        raise ValueError(f"{nominal} rollout samples are not a multiple of the global batch size {global_batch_size}")
    if num_samples < nominal:
        raise ValueError(f"{num_samples} samples are fewer than {num_groups} groups x {samples_per_prompt}")
    steps = nominal // global_batch_size
    return [(k + 1) * num_samples // steps - k * num_samples // steps for k in range(steps)]


def split_over_data_parallel(
    token_counts: list[int], step_sizes: list[int], num_ranks: int
) -> tuple[list[RankShare], float]:
    """Each rank's share of a rollout trained in optimizer steps of `step_sizes` consecutive samples
    (optimizer_step_sizes), every step's samples spread over the ranks by tokens (balanced_shares); and the worst
    step's token imbalance."""
    if sum(step_sizes) != len(token_counts):
        raise ValueError(f"optimizer steps of {step_sizes} samples for {len(token_counts)} rollout samples")
    shares = [RankShare() for _ in range(num_ranks)]
    worst, start = 1.0, 0
    for size in step_sizes:
        counts = token_counts[start : start + size]
        parts = balanced_shares(counts, num_ranks)
        worst = max(worst, token_imbalance(counts, parts))
        for share, part in zip(shares, parts):
            share.indices.extend(start + i for i in part)
            share.step_sizes.append(len(part))
        start += size
    return shares, worst


def plan_micro_batches(token_counts: list[int], micro_batch_size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Which samples go together: micro-batches as lists of sample indices (see module doc)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if not token_counts:
        raise ValueError("the batch has no samples; every data-parallel rank needs at least one")
    if max_tokens is None:
        indices = list(range(len(token_counts)))
        return [indices[s : s + micro_batch_size] for s in range(0, len(indices), micro_batch_size)]
    micro_batches, totals = [], []
    for i in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        if token_counts[i] > max_tokens:
            raise ValueError(
                f"sample {i} has {token_counts[i]} tokens, more than the {max_tokens} tokens a micro-batch may hold: "
                "raise --max-tokens-per-device to at least the longest prompt + response"
            )
        fits = next((m for m, total in enumerate(totals) if total + token_counts[i] <= max_tokens), None)
        if fits is None:
            micro_batches.append([])
            totals.append(0)
            fits = len(micro_batches) - 1
        micro_batches[fits].append(i)
        totals[fits] += token_counts[i]
    return [sorted(members) for members in micro_batches]


def plan_shape(token_counts: list[int], plan: list[list[int]], multiple: int = 1) -> tuple[int, int]:
    """(micro-batches, tokens) that hold every micro-batch of `plan`, tokens rounded up to `multiple`."""
    longest = max(sum(token_counts[i] for i in members) for members in plan)
    return len(plan), -(-longest // multiple) * multiple


@dataclass
class MicroBatch:
    """One packed row of samples (THD), and where each sample's response tokens sit in it."""

    tokens: torch.Tensor  # [1, t]
    position_ids: torch.Tensor  # [1, t]: each token's index in its own sequence
    cu_seqlens: torch.Tensor  # int32 [n + 1]: sequence boundaries along t (padding, if any, is the last sequence)
    max_seqlen: int
    sample_indices: list[int]  # into the RolloutBatch
    # per sample: (first logit position, response length); the logit at position p predicts token p + 1
    spans: list[tuple[int, int]] = field(default_factory=list)
    routed_experts: torch.Tensor | None = None  # routing replay: [t, layers, top-k], each position's experts
    # context parallelism: this rank's part of the row (relax.train.context_parallel.RowSplit), set by the actor
    row_split: object | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    def to(self, device) -> "MicroBatch":
        return MicroBatch(
            self.tokens.to(device),
            self.position_ids.to(device),
            self.cu_seqlens.to(device),
            self.max_seqlen,
            self.sample_indices,
            self.spans,
            None if self.routed_experts is None else self.routed_experts.to(device),
            self.row_split,
        )

    def packed_seq_params(self):
        """megatron-core's description of the packed row."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def response_values(self, per_position: torch.Tensor) -> list[torch.Tensor]:
        """Each sample's response-token slice of a per-position tensor [1, t]."""
        return [per_position[0, start : start + length] for start, length in self.spans]


def _rounded_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def pack_micro_batch(
    batch: RolloutBatch, members: list[int], num_tokens: int, pad_token_id: int = 0, sequence_multiple: int = 1
) -> MicroBatch:
    """The samples `members` of `batch` in one row of `num_tokens` tokens (the rest padding), each sample padded to a
    multiple of `sequence_multiple` tokens."""
    lengths = [batch.tokens[i].numel() for i in members]
    sequences = [_rounded_up(length, sequence_multiple) for length in lengths]
    padding = num_tokens - sum(sequences)
    if padding < 0:
        raise ValueError(f"{sum(sequences)} tokens do not fit a micro-batch of {num_tokens}")
    sequences += [padding] if padding else []
    parts = [
        part
        for i, length, sequence in zip(members, lengths, sequences)
        for part in (batch.tokens[i], torch.full((sequence - length,), pad_token_id, dtype=torch.long))
    ]
    parts.append(torch.full((padding,), pad_token_id, dtype=torch.long))
    cu_seqlens = torch.tensor([0] + sequences, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in sequences]) if sequences else torch.zeros(0, dtype=torch.long)
    spans = [
        (start + length - response_length - 1, response_length)
        for start, length, response_length in zip(
            cu_seqlens.tolist(), lengths, (batch.response_lengths[i] for i in members)
        )
    ]
    return MicroBatch(
        tokens=torch.cat(parts).unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(sequences),
        sample_indices=list(members),
        spans=spans,
        routed_experts=(
            None if batch.routed_experts is None else packed_routed_experts(batch, members, sequences, num_tokens)
        ),
    )


def packed_routed_experts(batch: RolloutBatch, members: list[int], sequences: list[int], num_tokens: int):
    """The routed experts of the samples `members`, each padded to its `sequences` length, laid out as
    pack_micro_batch lays out their tokens: [num_tokens, layers, top-k], experts 0 .. top-k - 1 where there is no
    record (see module doc)."""
    layers, top_k = batch.routed_experts[0].shape[1:]
    filler = torch.arange(top_k, dtype=batch.routed_experts[0].dtype).expand(1, layers, top_k)
    parts = [
        part
        for i, sequence in zip(members, sequences)
        for part in (batch.routed_experts[i], filler.expand(sequence - batch.routed_experts[i].shape[0], layers, top_k))
    ]
    packed = sum(part.shape[0] for part in parts)
    parts.append(filler.expand(num_tokens - packed, layers, top_k))  # padding
    return torch.cat(parts)


def make_micro_batches(
    batch: RolloutBatch,
    micro_batch_size: int,
    max_tokens: int | None = None,
    pad_token_id: int = 0,
    multiple: int = 1,
    uniform_shape: tuple[int, int] | None = None,
    sequence_multiple: int = 1,
) -> list[MicroBatch]:
    """Cut `batch` into packed micro-batches (see module doc), each padded to a multiple of `multiple` tokens
    (sequence parallelism splits a row's tokens over the tensor-parallel ranks) and each sample to a multiple of
    `sequence_multiple` (context parallelism; `multiple` must then be a multiple of it). The token budget
    `max_tokens` counts the samples' padded lengths.

    uniform_shape=(count, tokens) pads every micro-batch to `tokens` and adds all-padding micro-batches up to
    `count`: pipeline stages exchange activations of one fixed shape, and expert-parallel ranks exchange tokens in
    every micro-batch, so they need as many micro-batches of the same shape.
    """
    if multiple % sequence_multiple:
        raise ValueError(f"a row multiple of {multiple} tokens leaves padding not a multiple of {sequence_multiple}")
    counts = [_rounded_up(count, sequence_multiple) for count in batch.token_counts()]
    plan = plan_micro_batches(counts, micro_batch_size, max_tokens)
    if uniform_shape is not None:
        count, num_tokens = uniform_shape
        needed = plan_shape(counts, plan, multiple)
        if needed[0] > count or needed[1] > num_tokens:
            raise ValueError(f"uniform_shape {uniform_shape} is smaller than the batch's {needed}")
        return [
            pack_micro_batch(batch, members, num_tokens, pad_token_id, sequence_multiple)
            for members in plan + [[]] * (count - len(plan))
        ]
    return [
        pack_micro_batch(batch, members, plan_shape(counts, [members], multiple)[1], pad_token_id, sequence_multiple)
        for members in plan
    ]
