"""Triton kernels for relax.train.logprobs: the per-position statistics of the logits that the logprob and the entropy
come from (forward), and the gradient written into the logits' own buffer (backward). One pass over the logits each.

    stats = row_stats(flat_logits, labels, vocab_start, temperature, launch)     # float32 [4, positions]
    write_gradient(flat_logits, labels, vocab_start, temperature, log_normaliser, entropy,
                   logprobs_grad, entropy_grad, launch)                           # flat_logits := the gradient

relax.train.logprobs computes the same statistics with torch (its reference and the fallback where Triton does not
run) and combines them over the ranks that share the vocabulary. Written to the porting rules of
relax.kernels.gdn_triton: a 1-D grid of at most `launch.num_programs` programs, each looping over positions with a
stride of the grid size; launch keywords only from `launch.options`; the vocabulary streamed in tiles of
`launch.logprob_block_vocab` logits, never a whole row on chip.
"""

import torch
import triton
import triton.language as tl

from relax.kernels.launch import TritonLaunch


@triton.jit
def _row_stats(logits_ptr, labels_ptr, stats_ptr, positions, vocab, vocab_start, inv_temperature,
               BLOCK: tl.constexpr):
    """Per position, over this slice of the vocabulary, with s = logit / temperature: the maximum m of s, the sums of
    e^(s - m) and of e^(s - m) (s - m), and the label's s (0 where the slice does not hold the label), as rows 0-3 of
    stats [4, positions]. The sums are kept relative to the maximum so far and rescaled as it grows (online
    softmax), so the logits are read once."""
    columns = tl.arange(0, BLOCK)
    for position in range(tl.program_id(0), positions, tl.num_programs(0)):
        row = logits_ptr + tl.cast(position, tl.int64) * vocab
        # Starting from a logit of the row keeps the maximum finite, so the first rescale multiplies empty sums by a
        # finite factor. Columns past the vocabulary load as -inf (no part in the maximum) and count as 0 in the sums.
        maximum = tl.load(row).to(tl.float32) * inv_temperature
        total = tl.zeros((), tl.float32)
        weighted = tl.zeros((), tl.float32)
        for start in range(0, vocab, BLOCK):
            inside = start + columns < vocab
            scaled = tl.load(row + start + columns, mask=inside, other=-float("inf")).to(tl.float32) * inv_temperature
            grown = tl.maximum(maximum, tl.max(scaled, axis=0))
            rescale = tl.exp(maximum - grown)
            shifted = tl.where(inside, scaled - grown, 0.0)
            exp_shifted = tl.where(inside, tl.exp(shifted), 0.0)
            # sum e^(s - m') (s - m') over what came before = rescale * (weighted + (m - m') total)
            weighted = rescale * (weighted + (maximum - grown) * total) + tl.sum(exp_shifted * shifted, axis=0)
            total = rescale * total + tl.sum(exp_shifted, axis=0)
            maximum = grown
        label = (tl.load(labels_ptr + position) - vocab_start).to(tl.int32)
        holds_label = (label >= 0) & (label < vocab)
        label_scaled = tl.load(row + label, mask=holds_label, other=0.0).to(tl.float32) * inv_temperature
        tl.store(stats_ptr + position, maximum)
        tl.store(stats_ptr + positions + position, total)
        tl.store(stats_ptr + 2 * positions + position, weighted)
        tl.store(stats_ptr + 3 * positions + position, label_scaled)


@triton.jit
def _write_gradient(logits_ptr, labels_ptr, log_normaliser_ptr, entropy_ptr, logprobs_grad_ptr, entropy_grad_ptr,
                    positions, vocab, vocab_start, inv_temperature, BLOCK: tl.constexpr):
    """logits[position, v] := (-p_v (g_logprob + g_entropy (log p_v + H)) + g_logprob [v = label]) / temperature,
    with log p_v = logit_v / temperature - log Z over the whole vocabulary."""
    columns = tl.arange(0, BLOCK)
    for position in range(tl.program_id(0), positions, tl.num_programs(0)):
        row = logits_ptr + tl.cast(position, tl.int64) * vocab
        log_normaliser = tl.load(log_normaliser_ptr + position)
        entropy = tl.load(entropy_ptr + position)
        logprob_grad = tl.load(logprobs_grad_ptr + position)
        entropy_grad = tl.load(entropy_grad_ptr + position)
        # outside [0, vocab) where another slice holds it; int32 as the vocabulary indices it is compared with
        label = (tl.load(labels_ptr + position) - vocab_start).to(tl.int32)
        for start in range(0, vocab, BLOCK):
            vocab_index = start + columns
            inside = vocab_index < vocab
            log_p = tl.load(row + vocab_index, mask=inside, other=0.0).to(tl.float32) * inv_temperature - log_normaliser
            gradient = -tl.exp(log_p) * (logprob_grad + entropy_grad * (log_p + entropy))
            gradient += tl.where(vocab_index == label, logprob_grad, 0.0)
            tl.store(row + vocab_index, (gradient * inv_temperature).to(logits_ptr.dtype.element_ty), mask=inside)


def _grid(positions: int, launch: TritonLaunch) -> tuple[int]:
    return (max(1, min(positions, launch.num_programs)),)


def row_stats(flat_logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, temperature: float,
              launch: TritonLaunch) -> torch.Tensor:
    """float32 [4, positions] of contiguous flat_logits [positions, local vocab] and labels [positions] (whole
    vocabulary indices): the maximum m of logit / temperature, the sums of e^(s - m) and of e^(s - m) (s - m) over the
    slice, and the label's s where the slice holds it (0 elsewhere)."""
    positions, vocab = flat_logits.shape
    labels = labels.contiguous()
    stats = torch.empty(4, positions, dtype=torch.float32, device=flat_logits.device)
    if positions:
        _row_stats[_grid(positions, launch)](
            flat_logits, labels, stats, positions, vocab, vocab_start, 1.0 / temperature,
            BLOCK=launch.logprob_block_vocab, **launch.options,
        )
    return stats


def write_gradient(flat_logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, temperature: float,
                   log_normaliser: torch.Tensor, entropy: torch.Tensor, logprobs_grad: torch.Tensor,
                   entropy_grad: torch.Tensor, launch: TritonLaunch) -> None:
    """Overwrite contiguous flat_logits [positions, local vocab] with the gradient of the objective whose gradients
    with respect to the logprobs and the entropies are logprobs_grad and entropy_grad (float32 [positions]), given
    the whole vocabulary's log Z (of logit / temperature) and entropy per position."""
    positions, vocab = flat_logits.shape
    labels = labels.contiguous()
    if positions:
        _write_gradient[_grid(positions, launch)](
            flat_logits, labels, log_normaliser, entropy, logprobs_grad, entropy_grad, positions, vocab, vocab_start,
            1.0 / temperature, BLOCK=launch.logprob_block_vocab, **launch.options,
        )
