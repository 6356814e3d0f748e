"""Policy-gradient losses as plain functions of per-token tensors.

Every tensor here is [batch, response_len]: one row per sequence, response tokens only, right-padded,
with `mask` (1 for a real response token, 0 for padding). The functions know nothing about Megatron;
the actor computes logprobs and calls them.

Aggregation (how per-token values become one scalar) is explicit, because the algorithms differ on it:
- "token_mean": sum over every token of the batch / number of tokens (DAPO's token-level loss: long
  responses weigh more).
- "seq_mean_token_mean": mean over sequences of each sequence's token mean (GRPO's original form, and
  GSPO's objective once the ratio is per sequence).
- "seq_mean_token_sum": mean over sequences of each sequence's token sum.
- "seq_mean_token_sum_norm": token sum of the batch / (batch size * a fixed length), Dr. GRPO's
  length-unbiased form; the fixed length is `norm_length` (default: the padded response length).
"""

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")
LOSS_MODES = ("ppo", "cispo")
# verl's bounds: |log(pi / pi_old)| before exp, so one wild token gives a large finite ratio rather than inf and a
# NaN gradient; and the k3 KL estimate per token.
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0
DUAL_CLIP = 3.0  # verl's clip_ratio_c


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {list(choices)}")


def aggregation_denominator(mask: torch.Tensor, mode: str, norm_length: int | None = None) -> torch.Tensor:
    """What `aggregate` divides the masked sum by (for the sequence modes, after each sequence's own
    normalisation). An actor that splits a batch into micro-batches computes this once for the whole batch
    and passes it to every micro-batch, so the micro-batch losses add up to the batch's loss."""
    _check_choice("aggregation", mode, AGGREGATIONS)
    if mode == "token_mean":
        return mask.sum().clamp(min=1).to(torch.float32)
    if mode == "seq_mean_token_sum_norm":
        length = mask.shape[-1] if norm_length is None else norm_length
        return torch.tensor(float(mask.shape[0] * length))
    return torch.tensor(float(mask.shape[0]))


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    norm_length: int | None = None,
    denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce per-token `values` [B, T] over the tokens where `mask` is 1, as `mode` says (see module doc).
    `denominator` overrides aggregation_denominator(mask, ...) (a whole batch's, for a micro-batch)."""
    _check_choice("aggregation", mode, AGGREGATIONS)
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have the same shape")
    if denominator is None:
        denominator = aggregation_denominator(mask, mode, norm_length)
    mask = mask.to(values.dtype)
    masked = values * mask
    if mode == "seq_mean_token_mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / denominator
    return masked.sum() / denominator


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean over its response tokens: [B, T] -> [B]."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log(pi / pi_old) per token, [B, T].

    "token": the PPO ratio of each token. "sequence": GSPO's length-normalised sequence ratio
    s_i = exp(mean_t log(pi/pi_old)), given to every token of the sequence in value, while the gradient
    still reaches each token's logprob (GSPO-token: log s_i.detach() + logp - logp.detach()). With one
    advantage per sequence and seq_mean_token_mean aggregation this is exactly GSPO's gradient.
    """
    _check_choice("ratio level", level, RATIO_LEVELS)
    token_log_ratio = logprobs - old_logprobs
    if level == "token":
        return token_log_ratio
    seq_log_ratio = sequence_mean(token_log_ratio, mask).detach().unsqueeze(-1)
    return seq_log_ratio + logprobs - logprobs.detach()


def kl_divergence(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str,
    log_ratio_clamp: float | None = None,
    k3_clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1, k2, k3).

    k1 = log(pi/ref) (unbiased, can be negative); k2 = log(pi/ref)^2 / 2; k3 = ref/pi - 1 - log(ref/pi)
    (unbiased and never negative). For k3, log(pi/ref) is clamped to +-log_ratio_clamp before exp and the
    estimate to at most k3_clamp (None: unclamped).
    """
    _check_choice("kl estimator", estimator, KL_ESTIMATORS)
    log_r = logprobs - ref_logprobs
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if log_ratio_clamp is not None:
        log_r = log_r.clamp(-log_ratio_clamp, log_ratio_clamp)
    # ref/pi - 1 as expm1: near pi = ref, exp(-log_r) - 1 rounds to float32's steps around 1
    k3 = torch.expm1(-log_r) + log_r
    return k3 if k3_clamp is None else k3.clamp(max=k3_clamp)


def clipped_policy_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, with asymmetric bounds (DAPO's clip-higher: clip_high > clip_low)
    and dual-clip (Ye et al., arXiv:1912.09729; None turns it off).

    loss = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)), and where A < 0 at most -A * dual_clip: a
    token whose ratio has grown far past the clip range while its advantage is negative would otherwise push
    with a loss growing with r. Returns (loss, clipped, dual_clipped): `clipped` is 1 where the clipped term is
    the one taken (the token's gradient is cut), `dual_clipped` where the dual-clip bound is, for the metrics.
    """
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    return loss, (clipped > unclipped).to(ratio.dtype), dual_clipped.to(ratio.dtype)


def cispo_policy_loss(
    log_ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv:2506.13585) per token: -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi.

    The ratio is clipped under a stop-gradient and the gradient flows through log pi, so a clipped token
    still contributes (its weight is capped), where PPO's clip drops it. Returns (loss, clipped): `clipped`
    is 1 where the ratio was clamped.
    """
    ratio = torch.exp(log_ratio.detach())
    capped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -capped * advantages * logprobs, (capped != ratio).to(ratio.dtype)


@dataclass
class LossSettings:
    """What the actor's loss does. Defaults are GRPO with DAPO's clip-higher bounds."""

    loss_mode: str = "ppo"  # "cispo": CISPO's capped, stop-gradient ratio weight (cispo_policy_loss)
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = DUAL_CLIP  # ppo only: the loss of a negative-advantage token is at most -A * this
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP  # |log(pi / pi_old)| (and k3's |log(pi / ref)|) before exp
    k3_clamp: float | None = K3_CLAMP  # the largest per-token k3 KL estimate
    ratio_level: str = "token"  # "sequence" for GSPO (then typical clips are 3e-4 / 4e-4)
    aggregation: str = "token_mean"
    norm_length: int | None = None  # only for seq_mean_token_sum_norm
    kl_coef: float = 0.0  # KL-to-reference penalty in the loss; 0 turns it off
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0  # entropy bonus: loss -= entropy_coef * entropy

    def __post_init__(self):
        _check_choice("loss_mode", self.loss_mode, LOSS_MODES)
        _check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        if self.loss_mode == "cispo" and self.ratio_level != "token":
            raise ValueError("loss_mode cispo weights each token by its own ratio: use ratio_level='token'")
        _check_choice("aggregation", self.aggregation, AGGREGATIONS)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"clip bounds must be >= 0, got clip_low={self.clip_low}, clip_high={self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip bounds a ratio above 1 + clip_high: it must be > 1, got {self.dual_clip}")
        for name in ("log_ratio_clamp", "k3_clamp"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 (or None for no clamp), got {getattr(self, name)}")


def policy_loss(
    settings: LossSettings,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    denominator: torch.Tensor | float | None = None,
    num_tokens: torch.Tensor | float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss: clipped policy gradient (PPO's, or CISPO's with loss_mode "cispo") + kl_coef * KL
    - entropy_coef * entropy, all aggregated the same way. Returns (loss, metrics); metrics are detached
    scalars: loss, pg_loss, clip_fraction, dual_clip_fraction (ppo), ppo_kl (old -> new, k1, unclamped), kl
    (when ref_logprobs is given), entropy (when entropy is given).

    `token_weights` [B, T] (detached; e.g. relax.train.off_policy's importance weights) multiply each token's
    policy-gradient term, not the KL or entropy terms.

    For a micro-batch of a larger batch pass the whole batch's `denominator` (aggregation_denominator)
    and `num_tokens` (its response-token count, for the token-mean metrics): then the loss and every
    metric of the micro-batches add up to the whole batch's.
    """
    given = {"old_logprobs": old_logprobs, "advantages": advantages, "mask": mask, "token_weights": token_weights}
    for name, tensor in given.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs {tuple(logprobs.shape)}")
    if settings.kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef is set but no ref_logprobs were given: compute reference logprobs first")
    if settings.entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef is set but no per-token entropy was given")

    def agg(values):
        return aggregate(values, mask, settings.aggregation, settings.norm_length, denominator)

    def token_mean(values):
        return aggregate(values.detach(), mask, "token_mean", denominator=num_tokens)

    ratio_log = log_ratio(logprobs, old_logprobs, mask, settings.ratio_level)
    if settings.log_ratio_clamp is not None:
        ratio_log = ratio_log.clamp(-settings.log_ratio_clamp, settings.log_ratio_clamp)
    dual_clipped = None
    if settings.loss_mode == "cispo":
        pg_per_token, clipped = cispo_policy_loss(
            ratio_log, logprobs, advantages, settings.clip_low, settings.clip_high
        )
    else:
        pg_per_token, clipped, dual_clipped = clipped_policy_loss(
            ratio_log, advantages, settings.clip_low, settings.clip_high, settings.dual_clip
        )
    if token_weights is not None:
        pg_per_token = pg_per_token * token_weights.detach()
    pg_loss = agg(pg_per_token)
    loss = pg_loss
    metrics = {
        "pg_loss": pg_loss.detach(),
        "clip_fraction": token_mean(clipped),
        "ppo_kl": token_mean(old_logprobs - logprobs),
    }
    if dual_clipped is not None:
        metrics["dual_clip_fraction"] = token_mean(dual_clipped)
    if ref_logprobs is not None:
        kl = agg(
            kl_divergence(
                logprobs, ref_logprobs, settings.kl_estimator, settings.log_ratio_clamp, settings.k3_clamp
            )
        )
        loss = loss + settings.kl_coef * kl
        metrics["kl"] = kl.detach()
    if entropy is not None:
        mean_entropy = agg(entropy)
        loss = loss - settings.entropy_coef * mean_entropy
        metrics["entropy"] = mean_entropy.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics
