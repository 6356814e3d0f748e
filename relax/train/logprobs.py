"""Per-token logprob and entropy from logits whose vocabulary may be split over tensor-parallel ranks, without a
float32 [tokens, vocab] tensor.

    logprobs, entropy = logprobs_and_entropy(logits, labels, temperature=1.0)                  # whole vocabulary
    logprobs, entropy = logprobs_and_entropy(shard, labels, vocab_start=rank * shard.shape[-1],
                                             all_reduce=partial(torch.distributed.all_reduce, group=tp_group))
    logprobs, entropy = logprobs_and_entropy(logits, labels, launch=platform_launch(platform, device_index))
    logprobs, entropy = output_logprobs_and_entropy(hidden, output_weight_shard, labels, ...)  # no logits at all

The forward keeps per position only the log-normaliser and the entropy, from four statistics of this rank's slice
(its maximum, the sums of e^(s - max) and of e^(s - max) (s - max), the label's s) that two all-reduces combine over
the ranks. The backward recomputes the softmax from the saved logits and writes the gradient into the logits tensor
itself (the model's output, read by nothing after the loss): the one [tokens, vocab] buffer the forward already held
is the only one, as in Megatron's vocab-parallel cross entropy, which keeps its softmax in the logits' place.

Both passes over the logits come in two forms: torch over pieces of positions (CHUNK_BYTES of float32 per
temporary; the reference, and what runs where Triton does not), and relax.kernels.logprobs_triton's kernels, one
pass over the logits each, which a platform names by Platform.logprob_kernel.

output_logprobs_and_entropy goes one step further (the idea of Liger-Kernel's fused linear cross entropy): it takes
the output layer's input and weight, and the [tokens, vocab] logits are never held, only a piece of them at a time,
recomputed in the backward. The statistics, their combination over the ranks and the gradient formula are the same
functions on each piece.
"""

from typing import Callable

import torch
from torch.distributed import ReduceOp

from relax.kernels.launch import TritonLaunch

# float32 bytes of one [positions, local vocab] temporary: the piece of positions is CHUNK_BYTES / (4 * local vocab),
# 441 positions at a vocabulary of 151,936. A piece still spans about 67M elements, so each of its dozen kernels has
# far more work than its launch costs; larger pieces would cost memory (a few temporaries of this size) and save
# only launches. A budget in bytes, not a count of positions, keeps the temporaries the same size at any vocabulary
# and tensor-parallel split.
CHUNK_BYTES = 256 * 2**20

AllReduce = Callable[..., object]  # all_reduce(tensor, op=ReduceOp.X): in place, over the ranks sharing the vocab

# How a platform computes them (Platform.logprob_kernel): "torch" over pieces of positions (any device), "triton"
# with relax.kernels.logprobs_triton's one-pass kernels.
LOGPROB_KERNELS = ("torch", "triton")


def chunk_positions(local_vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * local_vocab))


def _local_labels(labels: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels as indices into this rank's slice of the vocabulary [positions, 1] (clamped into it, for gather and
    scatter) and whether the slice holds them [positions]."""
    local = labels.reshape(-1) - vocab_start
    in_slice = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1)[:, None], in_slice


def _row_stats(flat: torch.Tensor, labels: torch.Tensor, vocab_start: int, temperature: float) -> torch.Tensor:
    """float32 [4, positions] of flat [positions, local vocab], with s = logit / temperature over this slice: the
    maximum m of s, the sums of e^(s - m) and of e^(s - m) (s - m), and the label's s (0 where the slice does not hold
    the label). Pieces of positions at a time; relax.kernels.logprobs_triton.row_stats is the same in one pass."""
    positions, local_vocab = flat.shape
    local_labels, in_slice = _local_labels(labels, vocab_start, local_vocab)
    stats = torch.empty(4, positions, dtype=torch.float32, device=flat.device)
    stats[0] = flat.amax(-1).float() / temperature
    chunk = chunk_positions(local_vocab)
    for start in range(0, positions, chunk):
        rows = slice(start, start + chunk)
        scaled = flat[rows].float() / temperature
        stats[3, rows] = scaled.gather(-1, local_labels[rows]).squeeze(-1) * in_slice[rows]
        shifted = scaled.sub_(stats[0, rows, None])
        exp_shifted = shifted.exp()
        stats[1, rows] = exp_shifted.sum(-1)
        stats[2, rows] = shifted.mul_(exp_shifted).sum(-1)
    return stats


def _write_gradient(flat: torch.Tensor, labels: torch.Tensor, vocab_start: int, temperature: float,
                    log_normaliser: torch.Tensor, entropy: torch.Tensor, logprobs_grad: torch.Tensor,
                    entropy_grad: torch.Tensor) -> None:
    """Overwrite flat [positions, local vocab] with the logits' gradient, pieces of positions at a time;
    relax.kernels.logprobs_triton.write_gradient is the same in one pass.

    d log p_label / d s_v = [v = label] - p_v and d H / d s_v = -p_v (log p_v + H), so the gradient is
    -p_v (g_logprob + g_entropy (log p_v + H)) + g_logprob [v = label], times 1 / temperature for the logits."""
    positions, local_vocab = flat.shape
    local_labels, in_slice = _local_labels(labels, vocab_start, local_vocab)
    label_grad = (logprobs_grad * in_slice)[:, None]
    chunk = chunk_positions(local_vocab)
    for start in range(0, positions, chunk):
        rows = slice(start, start + chunk)
        log_p = flat[rows].float() / temperature - log_normaliser[rows, None]
        p = log_p.exp()
        grad = log_p.add_(entropy[rows, None]).mul_(entropy_grad[rows, None]).add_(logprobs_grad[rows, None])
        grad.mul_(p).neg_().scatter_add_(-1, local_labels[rows], label_grad[rows])
        flat[rows] = grad.div_(temperature)


def _stats(flat: torch.Tensor, labels: torch.Tensor, vocab_start: int, temperature: float,
           launch: TritonLaunch | None) -> torch.Tensor:
    """_row_stats, or relax.kernels.logprobs_triton's one-pass kernel with a launch record."""
    if launch is None:
        return _row_stats(flat, labels, vocab_start, temperature)
    from relax.kernels import logprobs_triton  # Triton imported only where a launch record asks for it

    return logprobs_triton.row_stats(flat, labels, vocab_start, temperature, launch)


def _gradient(flat: torch.Tensor, labels: torch.Tensor, vocab_start: int, temperature: float, launch, saved,
              logprobs_grad, entropy_grad) -> None:
    """Overwrite flat [positions, local vocab] with its gradient (_write_gradient, or the Triton kernel), given the
    forward's saved log-normaliser and entropy and the outputs' gradients (None: no gradient)."""
    log_normaliser, entropy = saved
    zeros = torch.zeros_like(entropy)
    logprobs_grad = zeros if logprobs_grad is None else logprobs_grad.reshape(-1).float().contiguous()
    entropy_grad = zeros if entropy_grad is None else entropy_grad.reshape(-1).float().contiguous()
    arguments = (flat, labels, vocab_start, temperature, log_normaliser, entropy, logprobs_grad, entropy_grad)
    if launch is None:
        _write_gradient(*arguments)
    else:
        from relax.kernels import logprobs_triton

        logprobs_triton.write_gradient(*arguments, launch)


def _combine(stats: torch.Tensor, in_slice: torch.Tensor, all_reduce: AllReduce | None):
    """(logprobs, entropy, log-normaliser) per position from this rank's _row_stats and whether its slice holds
    each label.

    Over the ranks sharing the vocabulary: the maximum first (an all-reduce of its own), then each rank's sums moved
    from its own maximum to the common one and added up, with the label's s - maximum from the one rank that holds it.
    On one rank the move multiplies by e^0 = 1 and adds 0: the sums are this rank's."""
    local_maximum, local_partition, local_weighted, label_scaled = stats
    maximum = local_maximum.clone()
    if all_reduce is not None:
        all_reduce(maximum, op=ReduceOp.MAX)
    offset = local_maximum - maximum  # <= 0
    rescale = offset.exp()
    sums = torch.stack([
        rescale * local_partition,
        rescale * (local_weighted + offset * local_partition),  # sum e^(s - M) (s - M), s - M = s - m + offset
        (label_scaled - maximum) * in_slice,
    ])
    if all_reduce is not None:
        all_reduce(sums, op=ReduceOp.SUM)
    partition, weighted, label_shifted = sums
    log_z = partition.log()
    entropy = log_z - weighted / partition  # -sum_v p_v log p_v, with log p_v = s_v - log Z
    return label_shifted - log_z, entropy, maximum + log_z


class _LogprobsAndEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature: float, vocab_start: int, all_reduce: AllReduce | None,
                launch: TritonLaunch | None):
        logits = logits.contiguous()  # the backward writes into it through a [positions, local vocab] view
        flat = logits.detach().view(-1, logits.shape[-1])
        flat_labels = labels.reshape(-1)
        stats = _stats(flat, flat_labels, vocab_start, temperature, launch)
        _, in_slice = _local_labels(flat_labels, vocab_start, flat.shape[-1])
        logprobs, entropy, log_normaliser = _combine(stats, in_slice, all_reduce)
        ctx.save_for_backward(logits, flat_labels, log_normaliser, entropy)
        ctx.temperature, ctx.vocab_start, ctx.launch = temperature, vocab_start, launch
        ctx.set_materialize_grads(False)
        return logprobs.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    def backward(ctx, logprobs_grad, entropy_grad):
        logits, labels, log_normaliser, entropy = ctx.saved_tensors
        gradient = logits.detach()  # the logits' own buffer
        _gradient(gradient.view(-1, logits.shape[-1]), labels, ctx.vocab_start, ctx.temperature, ctx.launch,
                  (log_normaliser, entropy), logprobs_grad, entropy_grad)
        return gradient, None, None, None, None, None


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    vocab_start: int = 0,
    all_reduce: AllReduce | None = None,
    launch: TritonLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) and the entropy (nats) per position of logits [..., local vocab] / temperature, float32 [...].

    With a vocabulary split over ranks, `logits` is this rank's slice starting at token `vocab_start`, and
    all_reduce(tensor, op=ReduceOp.MAX or SUM) reduces a tensor in place over the ranks holding the other slices
    (e.g. torch.distributed.all_reduce with the tensor-parallel group); every rank gets the whole-vocabulary values,
    and the backward gives each rank the gradient of its own slice. Both outputs are differentiable; the backward
    overwrites `logits` with its gradient, so `logits` must be read by nothing after the forward.

    With a launch record (relax.kernels.launch; `platform_launch` gives the platform's) the passes over the logits
    are relax.kernels.logprobs_triton's fused kernels; without one, torch over pieces of positions.
    """
    if temperature <= 0.0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return _LogprobsAndEntropy.apply(logits, labels, temperature, vocab_start, all_reduce, launch)


class _OutputLogprobsAndEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, vocab_start: int, all_reduce: AllReduce | None,
                launch: TritonLaunch | None):
        positions, local_vocab = hidden.shape[0], weight.shape[0]
        rows = max(1, CHUNK_BYTES // (hidden.element_size() * local_vocab))
        stats = torch.cat([
            _stats(hidden[start:start + rows] @ weight.T, labels[start:start + rows], vocab_start, temperature, launch)
            for start in range(0, positions, rows)
        ], dim=1)
        _, in_slice = _local_labels(labels, vocab_start, local_vocab)
        logprobs, entropy, log_normaliser = _combine(stats, in_slice, all_reduce)
        ctx.save_for_backward(hidden, weight, labels, log_normaliser, entropy)
        ctx.temperature, ctx.vocab_start, ctx.launch = temperature, vocab_start, launch
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, logprobs_grad, entropy_grad):
        # Pieces of the vocabulary here, not of positions: a piece's logits [positions, columns] hold every position,
        # so the weight's gradient of its columns is one matmul over all positions (rounded once to the weight's
        # dtype, as the output layer's own backward rounds it), and only the hidden states' gradient, [positions,
        # hidden], adds up over the pieces, in float32. The saved log-normaliser and entropy make each piece's
        # softmax gradient whole by itself.
        hidden, weight, labels, log_normaliser, entropy = ctx.saved_tensors
        positions, local_vocab = hidden.shape[0], weight.shape[0]
        hidden_grad = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        weight_grad = torch.empty_like(weight)
        columns = max(1, CHUNK_BYTES // (hidden.element_size() * positions))
        for start in range(0, local_vocab, columns):
            piece = slice(start, start + columns)
            logits = hidden @ weight[piece].T
            _gradient(logits, labels, ctx.vocab_start + start, ctx.temperature, ctx.launch, (log_normaliser, entropy),
                      logprobs_grad, entropy_grad)
            torch.mm(logits.T, hidden, out=weight_grad[piece])
            hidden_grad += logits @ weight[piece]
        return hidden_grad.to(hidden.dtype), weight_grad, None, None, None, None, None


def output_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                temperature: float = 1.0, vocab_start: int = 0, all_reduce: AllReduce | None = None,
                                launch: TritonLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs_and_entropy(hidden @ weight.T, labels, ...) without the logits [positions, local vocab]: the output
    projection fused with the statistics, float32 [positions] each, from hidden states [positions, hidden] and this
    rank's rows of the output weight [local vocab, hidden] (the vocabulary from token `vocab_start`; all_reduce as for
    logprobs_and_entropy). The forward multiplies pieces of positions (CHUNK_BYTES of logits in the hidden states'
    dtype each) and keeps per position only the log-normaliser and the entropy; the backward recomputes the logits
    a piece of the vocabulary at a time. Both outputs are differentiable, with respect to `hidden` (this rank's part
    of its gradient: the ranks sharing the vocabulary add theirs up) and `weight`."""
    if temperature <= 0.0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and output weight {tuple(weight.shape)} must be "
                         "[positions, hidden] and [local vocab, hidden]")
    return _OutputLogprobsAndEntropy.apply(hidden, weight, labels.reshape(-1), temperature, vocab_start, all_reduce,
                                           launch)


def platform_launch(platform, device_index: int) -> TritonLaunch | None:
    """The launch record logprobs_and_entropy takes on `platform`'s device `device_index`: that of its Triton target
    where the platform computes logprobs with the fused kernels (Platform.logprob_kernel "triton"), else None."""
    if platform.logprob_kernel == "torch":
        return None
    if platform.logprob_kernel != "triton":
        raise ValueError(f"unknown logprob kernel {platform.logprob_kernel!r} of {platform}: choose one of "
                         f"{', '.join(LOGPROB_KERNELS)}")
    return platform.triton_launch(device_index)
