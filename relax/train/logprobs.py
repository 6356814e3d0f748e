"""Per-token logprob and entropy from logits whose vocabulary may be split over tensor-parallel ranks, without a
float32 [tokens, vocab] tensor.

    logprobs, entropy = logprobs_and_entropy(logits, labels, temperature=1.0)                  # whole vocabulary
    logprobs, entropy = logprobs_and_entropy(shard, labels, vocab_start=rank * shard.shape[-1],
                                             all_reduce=partial(torch.distributed.all_reduce, group=tp_group))

The forward runs over pieces of positions (CHUNK_BYTES of float32 per temporary) and keeps per position only the
log-normaliser and the entropy. The backward recomputes each piece's softmax from the saved logits and writes the
gradient into the logits tensor itself, piece by piece (the model's output, read by nothing after the loss): the
one [tokens, vocab] buffer the forward already held is the only one, as in Megatron's vocab-parallel cross entropy,
which keeps its softmax in the logits' place.
"""

from typing import Callable

import torch
from torch.distributed import ReduceOp

# float32 bytes of one [positions, local vocab] temporary: the piece of positions is CHUNK_BYTES / (4 * local vocab),
# 441 positions at a vocabulary of 151,936. A piece still spans about 67M elements, so each of its dozen kernels has
# far more work than its launch costs; larger pieces would cost memory (a few temporaries of this size) and save
# only launches. A budget in bytes, not a count of positions, keeps the temporaries the same size at any vocabulary
# and tensor-parallel split.
CHUNK_BYTES = 256 * 2**20

AllReduce = Callable[..., object]  # all_reduce(tensor, op=ReduceOp.X): in place, over the ranks sharing the vocab


def chunk_positions(local_vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * local_vocab))


def _local_labels(labels: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels as indices into this rank's slice of the vocabulary [positions, 1] (clamped into it, for gather and
    scatter) and whether the slice holds them [positions]."""
    local = labels.reshape(-1) - vocab_start
    in_slice = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1)[:, None], in_slice


class _LogprobsAndEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature: float, vocab_start: int, all_reduce: AllReduce | None):
        logits = logits.contiguous()  # the backward writes into it through a [positions, local vocab] view
        flat = logits.view(-1, logits.shape[-1])
        positions, local_vocab = flat.shape
        local_labels, in_slice = _local_labels(labels, vocab_start, local_vocab)

        # The maximum first (an all-reduce of its own), then per position: the sum of e^s, of e^s * s, and the label's
        # s, where s is the scaled logit minus the maximum; the label's s comes from the one rank that holds it.
        maximum = flat.detach().amax(-1).float() / temperature
        if all_reduce is not None:
            all_reduce(maximum, op=ReduceOp.MAX)
        sums = torch.empty(3, positions, dtype=torch.float32, device=flat.device)
        chunk = chunk_positions(local_vocab)
        for start in range(0, positions, chunk):
            rows = slice(start, start + chunk)
            shifted = flat[rows].float() / temperature - maximum[rows, None]
            sums[2, rows] = shifted.gather(-1, local_labels[rows]).squeeze(-1) * in_slice[rows]
            exp_shifted = shifted.exp()
            sums[0, rows] = exp_shifted.sum(-1)
            sums[1, rows] = shifted.mul_(exp_shifted).sum(-1)
        if all_reduce is not None:
            all_reduce(sums, op=ReduceOp.SUM)
        partition, weighted, label_shifted = sums
        log_z = partition.log()
        logprobs = label_shifted - log_z
        entropy = log_z - weighted / partition  # -sum_v p_v log p_v, with log p_v = s_v - log Z
        ctx.save_for_backward(logits, labels, maximum + log_z, entropy)
        ctx.temperature, ctx.vocab_start = temperature, vocab_start
        ctx.set_materialize_grads(False)
        return logprobs.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    def backward(ctx, logprobs_grad, entropy_grad):
        # d log p_label / d s_v = [v = label] - p_v and d H / d s_v = -p_v (log p_v + H), so the gradient is
        # -p_v (g_logprob + g_entropy (log p_v + H)) + g_logprob [v = label], times 1 / temperature for the logits.
        logits, labels, log_normaliser, entropy = ctx.saved_tensors
        gradient = logits.detach()  # the logits' own buffer
        flat = gradient.view(-1, logits.shape[-1])
        positions, local_vocab = flat.shape
        zeros = torch.zeros_like(entropy)
        logprobs_grad = zeros if logprobs_grad is None else logprobs_grad.reshape(-1).float()
        entropy_grad = zeros if entropy_grad is None else entropy_grad.reshape(-1).float()
        local_labels, in_slice = _local_labels(labels, ctx.vocab_start, local_vocab)
        label_grad = (logprobs_grad * in_slice)[:, None]
        chunk = chunk_positions(local_vocab)
        for start in range(0, positions, chunk):
            rows = slice(start, start + chunk)
            log_p = flat[rows].float() / ctx.temperature - log_normaliser[rows, None]
            p = log_p.exp()
            grad = log_p.add_(entropy[rows, None]).mul_(entropy_grad[rows, None]).add_(logprobs_grad[rows, None])
            grad.mul_(p).neg_().scatter_add_(-1, local_labels[rows], label_grad[rows])
            flat[rows] = grad.div_(ctx.temperature)
        return gradient, None, None, None, None


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    vocab_start: int = 0,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) and the entropy (nats) per position of logits [..., local vocab] / temperature, float32 [...].

    With a vocabulary split over ranks, `logits` is this rank's slice starting at token `vocab_start`, and
    all_reduce(tensor, op=ReduceOp.MAX or SUM) reduces a tensor in place over the ranks holding the other slices
    (e.g. torch.distributed.all_reduce with the tensor-parallel group); every rank gets the whole-vocabulary values,
    and the backward gives each rank the gradient of its own slice. Both outputs are differentiable; the backward
    overwrites `logits` with its gradient, so `logits` must be read by nothing after the forward.
    """
    if temperature <= 0.0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return _LogprobsAndEntropy.apply(logits, labels, temperature, vocab_start, all_reduce)
