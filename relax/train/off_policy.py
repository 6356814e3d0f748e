"""The gap between the rollout engine's policy and the actor's, measured and corrected, as plain functions of
per-token tensors [batch, response_len] (right-padded; `mask` is 1 on response tokens), like relax.train.losses.

The engine samples each response from pi_rollout and reports log pi_rollout per token; the actor computes
log pi_old for the same tokens with the same weights. Different kernels, precisions or MoE routing make the
two differ, and the policy gradient, which takes its samples as drawn from pi_old, is then biased. The
per-token ratio pi_old / pi_rollout measures the gap (mismatch_metrics) and corrects it:

- TIS, truncated importance sampling (slime's --use-tis): each token's policy-gradient term is weighted by
  its ratio clamped into [tis_clip_low, tis_clip].
- MIS, masked importance sampling at the sequence level (verl's rollout_rs "seq_mean_k1"): a sequence whose
  geometric-mean ratio exp(mean_t log ratio) leaves [low, high] gets weight 0. Its tokens still count in the
  loss's denominator: the batch's loss stays an average over every sampled token, the dropped ones adding 0.
- use_rollout_logprobs (slime's --use-rollout-logprobs, verl's bypass mode): log pi_rollout is the PPO old
  policy, so PPO's own ratio pi / pi_rollout takes the gap into account.

Weights are detached: they scale gradients, they are not trained through.
"""

import math
from dataclasses import dataclass

import torch

from relax.train.losses import LOG_RATIO_CLAMP, LossSettings, aggregate, policy_loss, sequence_mean

RATIO_RANGE = (0.5, 2.0)  # mismatch/ratio_outside_0.5_2_fraction: the tokens whose ratio falls outside


@dataclass(frozen=True)
class RolloutCorrection:
    """Which correction the actor's loss applies (module doc). The defaults apply none."""

    tis_clip: float | None = None  # TIS: the cap C on each token's weight; None turns TIS off
    tis_clip_low: float = 0.0  # TIS: the floor of each token's weight
    mis_bounds: tuple[float, float] | None = None  # MIS: keep sequences whose geometric-mean ratio is in [low, high]
    use_rollout_logprobs: bool = False

    def __post_init__(self):
        if self.tis_clip is not None and not (self.tis_clip > 0.0 and 0.0 <= self.tis_clip_low <= self.tis_clip):
            raise ValueError(
                f"TIS needs 0 <= tis_clip_low <= tis_clip and tis_clip > 0, got {self.tis_clip_low} and {self.tis_clip}"
            )
        if self.mis_bounds is not None:
            low, high = self.mis_bounds
            if not 0.0 < low <= 1.0 <= high or low == high:
                raise ValueError(f"MIS bounds must satisfy 0 < low <= 1 <= high and low < high, got {self.mis_bounds}")
        if self.tis_clip is not None and self.use_rollout_logprobs:
            raise ValueError(
                "TIS and use_rollout_logprobs exclude each other: with the rollout logprobs as the old policy, "
                "PPO's ratio already weighs each token by pi / pi_rollout"
            )

    @property
    def needs_rollout_logprobs(self) -> bool:
        """Whether the loss needs the engine's logprobs (the mismatch metrics alone do not)."""
        return self.tis_clip is not None or self.mis_bounds is not None or self.use_rollout_logprobs


def rollout_log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """log(pi_old / pi_rollout) per token, clamped to +-LOG_RATIO_CLAMP before any exp (a wild token gives a
    large finite ratio, not inf)."""
    return (old_logprobs - rollout_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens) -> torch.Tensor:
    return aggregate(values.detach().float(), mask, "token_mean", denominator=num_tokens)


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    fill = -math.inf if largest else math.inf
    masked = values.detach().float().masked_fill(mask == 0, fill)
    return masked.max() if largest else masked.min()


def mismatch_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, num_tokens=None
) -> dict[str, torch.Tensor]:
    """How far the actor's logprobs are from the engine's on the same tokens, as detached scalars:
    |delta logprob| mean and max, the k3 estimate of KL(pi_rollout || pi_old) (tokens are sampled by the
    rollout), and the ratio pi_old / pi_rollout's mean, min, max and fraction outside RATIO_RANGE.

    Means divide by `num_tokens` (default: the mask's count); pass a whole batch's count and the means of its
    micro-batches add up to the batch's, while the _max / _min values combine by max / min.
    """
    delta = (old_logprobs - rollout_logprobs).abs()
    log_ratio = rollout_log_ratio(old_logprobs, rollout_logprobs)
    ratio = log_ratio.exp()
    low, high = RATIO_RANGE
    return {
        "mismatch/logprob_abs_diff_mean": _token_mean(delta, mask, num_tokens),
        "mismatch/logprob_abs_diff_max": _masked_extreme(delta, mask, largest=True),
        # r - 1 - log r as expm1(log r) - log r: for the 1e-7-sized gaps of identical math, r - 1 rounds to
        # float32's steps around 1 and gives noise of either sign instead of a value near 0
        "mismatch/k3_kl": _token_mean(torch.expm1(log_ratio) - log_ratio, mask, num_tokens),
        "mismatch/ratio_mean": _token_mean(ratio, mask, num_tokens),
        "mismatch/ratio_min": _masked_extreme(ratio, mask, largest=False),
        "mismatch/ratio_max": _masked_extreme(ratio, mask, largest=True),
        "mismatch/ratio_outside_0.5_2_fraction": _token_mean((ratio < low) | (ratio > high), mask, num_tokens),
    }


def tis_weights(log_ratio: torch.Tensor, clip: float, clip_low: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """TIS: each token's ratio clamped into [clip_low, clip]. Returns (weights, truncated): `truncated` is 1
    where the clamp changed the ratio."""
    ratio = log_ratio.detach().exp()
    weights = ratio.clamp(clip_low, clip)
    return weights, (weights != ratio).float()


def mis_keep(log_ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """MIS: per sequence [B], True where the geometric-mean ratio exp(mean_t log ratio) lies in [low, high]."""
    sequence_log_ratio = sequence_mean(log_ratio.detach(), mask)
    return (sequence_log_ratio >= math.log(low)) & (sequence_log_ratio <= math.log(high))


def importance_weights(
    correction: RolloutCorrection,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    num_tokens=None,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The per-token weights [B, T] that TIS and MIS put on the policy-gradient term (None when neither is
    on), and what they did: mismatch/tis_clip_fraction (tokens whose weight TIS truncated) and
    mismatch/mis_masked_fraction (tokens of the sequences MIS dropped), token means over `num_tokens`."""
    log_ratio = rollout_log_ratio(old_logprobs, rollout_logprobs)
    weights, metrics = None, {}
    if correction.tis_clip is not None:
        weights, truncated = tis_weights(log_ratio, correction.tis_clip, correction.tis_clip_low)
        metrics["mismatch/tis_clip_fraction"] = _token_mean(truncated, mask, num_tokens)
    if correction.mis_bounds is not None:
        keep = mis_keep(log_ratio, mask, *correction.mis_bounds).unsqueeze(-1).to(log_ratio.dtype)
        weights = keep.expand_as(log_ratio) if weights is None else weights * keep
        metrics["mismatch/mis_masked_fraction"] = _token_mean((1 - keep).expand_as(log_ratio), mask, num_tokens)
    return weights, metrics


def corrected_policy_loss(
    settings: LossSettings,
    correction: RolloutCorrection,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    denominator=None,
    num_tokens=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss on one micro-batch: relax.train.losses.policy_loss with `correction` applied, and its
    metrics plus the mismatch metrics (when the rollout logprobs are given).

    old_logprobs=None takes the current logprobs, detached, as the old policy's (right while the weights have
    not moved since the rollout: the first optimizer step of a rollout). `denominator` and `num_tokens` are
    the whole batch's, as for policy_loss.
    """
    actor_old = logprobs.detach() if old_logprobs is None else old_logprobs
    if rollout_logprobs is None:
        if correction.needs_rollout_logprobs:
            raise ValueError("TIS, MIS and use_rollout_logprobs need the engine's rollout logprobs of every sample")
        return policy_loss(
            settings, logprobs, actor_old, advantages, mask, ref_logprobs, entropy, denominator, num_tokens
        )
    metrics = mismatch_metrics(actor_old, rollout_logprobs, mask, num_tokens)
    weights, correction_metrics = importance_weights(correction, actor_old, rollout_logprobs, mask, num_tokens)
    loss, loss_metrics = policy_loss(
        settings,
        logprobs,
        rollout_logprobs if correction.use_rollout_logprobs else actor_old,
        advantages,
        mask,
        ref_logprobs,
        entropy,
        denominator,
        num_tokens,
        token_weights=weights,
    )
    return loss, {**loss_metrics, **metrics, **correction_metrics}
