"""Rollout samples as the actor consumes them, and how they are cut into Megatron micro-batches.

A sample is one prompt + response token sequence; only response tokens are scored and trained. Per
response token it may carry an advantage, the old policy's logprob, the reference policy's logprob and the
rollout engine's logprob (what the engine reported when it sampled the token).

Micro-batches are formed in rollout order. Without a token budget, `micro_batch_size` samples make one
micro-batch, one padded row each. With a token budget (dynamic batch size), consecutive samples are
packed into one row while the row stays within the budget; a row holds several sequences separated by a
block-diagonal causal mask, and each sequence's positions start at 0, so packing changes no logit.
A micro-batch whose rows hold one sequence each carries no mask: its padding follows the sequence, so the
attention's own causal mask gives the same logits without a [rows, 1, seq, seq] mask built on the host and
copied per micro-batch (megatron-core's local attention with such a mask peaked 34 GB higher on an H200 at
4 x 2048 tokens, docs/benchmarks.md).
"""

from dataclasses import dataclass, field

import torch


@dataclass
class RolloutBatch:
    """This data-parallel rank's samples. Lists are per sample; tensors are 1-D over response tokens."""

    tokens: list[torch.Tensor]  # prompt + response token ids
    response_lengths: list[int]
    advantages: list[torch.Tensor] | None = None
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    rollout_logprobs: list[torch.Tensor] | None = None

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
        for name in ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs"):
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

    def __len__(self):
        return len(self.tokens)


@dataclass
class MicroBatch:
    """Model inputs for some samples, and where each sample's response tokens sit in them."""

    tokens: torch.Tensor  # [rows, seq]
    position_ids: torch.Tensor  # [rows, seq]
    attention_mask: torch.Tensor | None  # [rows, 1, seq, seq] bool, True = masked out; None: causal
    sample_indices: list[int]  # into the RolloutBatch
    # per sample: (row, first logit position, response length); the logit at position p predicts token p + 1
    spans: list[tuple[int, int, int]] = field(default_factory=list)

    def to(self, device) -> "MicroBatch":
        return MicroBatch(
            self.tokens.to(device),
            self.position_ids.to(device),
            None if self.attention_mask is None else self.attention_mask.to(device),
            self.sample_indices,
            self.spans,
        )

    def response_values(self, per_position: torch.Tensor) -> list[torch.Tensor]:
        """Each sample's response-token slice of a per-position tensor [rows, seq]."""
        return [per_position[row, start : start + length] for row, start, length in self.spans]


def _rows(batch: RolloutBatch, micro_batch_size: int, max_tokens: int | None) -> list[list[list[int]]]:
    """Micro-batches as lists of rows, each row a list of sample indices."""
    if max_tokens is None:
        indices = list(range(len(batch)))
        return [[[i] for i in indices[s : s + micro_batch_size]] for s in range(0, len(batch), micro_batch_size)]
    micro_batches, row, row_tokens = [], [], 0
    for i, tokens in enumerate(batch.tokens):
        if tokens.numel() > max_tokens:
            raise ValueError(
                f"sample {i} has {tokens.numel()} tokens, more than max_tokens_per_micro_batch={max_tokens}: "
                "raise the budget to at least the longest prompt + response"
            )
        if row and row_tokens + tokens.numel() > max_tokens:
            micro_batches.append([row])
            row, row_tokens = [], 0
        row.append(i)
        row_tokens += tokens.numel()
    if row:
        micro_batches.append([row])
    return micro_batches


def plan_micro_batches(
    batch: RolloutBatch, micro_batch_size: int, max_tokens: int | None = None
) -> list[list[list[int]]]:
    """Which samples go together: micro-batches as lists of rows, each row a list of sample indices."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if len(batch) == 0:
        raise ValueError("the batch has no samples; every data-parallel rank needs at least one")
    return _rows(batch, micro_batch_size, max_tokens)


def plan_shape(batch: RolloutBatch, plan: list[list[list[int]]]) -> tuple[int, int, int]:
    """(micro-batches, rows, seq) that hold every micro-batch of `plan`."""
    seq = max(sum(batch.tokens[i].numel() for i in row) for rows in plan for row in rows)
    return len(plan), max(len(rows) for rows in plan), seq


def make_micro_batches(
    batch: RolloutBatch,
    micro_batch_size: int,
    max_tokens: int | None = None,
    pad_token_id: int = 0,
    uniform_shape: tuple[int, int, int] | None = None,
) -> list[MicroBatch]:
    """Cut `batch` into micro-batches (see module doc).

    uniform_shape=(count, rows, seq) pads every micro-batch to [rows, seq] and adds all-padding micro-batches
    up to `count`: pipeline stages exchange activations of one fixed shape, and expert-parallel ranks
    exchange tokens in every micro-batch, so they need as many micro-batches of the same shape.
    """
    plan = plan_micro_batches(batch, micro_batch_size, max_tokens)
    if uniform_shape is not None:
        count, rows, seq = uniform_shape
        if any(needed > given for needed, given in zip(plan_shape(batch, plan), uniform_shape)):
            raise ValueError(f"uniform_shape {uniform_shape} is smaller than the batch's {plan_shape(batch, plan)}")
        plan = plan + [[]] * (count - len(plan))

    micro_batches = []
    for rows in plan:
        if uniform_shape is not None:
            num_rows, seq = uniform_shape[1], uniform_shape[2]
        else:
            num_rows, seq = plan_shape(batch, [rows])[1:]
        tokens = torch.full((num_rows, seq), pad_token_id, dtype=torch.long)
        position_ids = torch.zeros((num_rows, seq), dtype=torch.long)
        packed = any(len(row) > 1 for row in rows)
        # Padding attends to itself only, so no softmax row is empty; its outputs are never read.
        allowed = torch.eye(seq, dtype=torch.bool).repeat(num_rows, 1, 1) if packed else None
        sample_indices, spans = [], []
        for r, row in enumerate(rows):
            offset = 0
            for i in row:
                n = batch.tokens[i].numel()
                tokens[r, offset : offset + n] = batch.tokens[i]
                position_ids[r, offset : offset + n] = torch.arange(n)
                if packed:
                    allowed[r, offset : offset + n, offset : offset + n] = torch.ones(n, n, dtype=torch.bool).tril()
                response_length = batch.response_lengths[i]
                sample_indices.append(i)
                spans.append((r, offset + n - response_length - 1, response_length))
                offset += n
        mask = ~allowed.unsqueeze(1) if packed else None
        micro_batches.append(MicroBatch(tokens, position_ids, mask, sample_indices, spans))
    return micro_batches
