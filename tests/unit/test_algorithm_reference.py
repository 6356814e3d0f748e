"""relax's algorithm math against reference formulas written here from the published definitions, on random
inputs: advantages, the policy losses (PPO-clip with clip-higher, dual-clip and the log-ratio clamp; CISPO; GSPO),
every loss aggregation (micro-batches included), the KL estimators, TIS / MIS and the mismatch metrics, and DAPO's
overlong penalty. Values and, where relax returns a differentiable loss, gradients.

The references work sequence by sequence on each response's own tokens in float64 (plain loops, no padding, no
mask), where relax works on padded float32 [batch, response_len] tensors with a mask: the padding is filled with
junk, so a mask that leaks shows. They call nothing of relax. Where the papers leave a convention open, the
reference states the one relax follows and where it comes from ("verl's" or "slime's" names a fact about those
projects' semantics; none of their code is used). Inputs include group sizes from 2 to 8, ragged response
lengths, groups of equal rewards and log-ratios far past every clamp (+-25, 50, 89).
"""

import math
import random

import pytest
import torch

from relax.rollout.data import Prompt
from relax.rollout.groups import Sample, apply_overlong_penalty, overlong_penalty
from relax.train.algorithms import ESTIMATORS, compute_advantages
from relax.train.losses import AGGREGATIONS, LossSettings, aggregation_denominator, kl_divergence, policy_loss
from relax.train.off_policy import RolloutCorrection, corrected_policy_loss, mismatch_metrics

SEEDS = range(12)
EXTREME_LOG_RATIOS = (-89.0, -50.0, -25.0, 25.0, 50.0, 89.0)
LOG_RATIO_CLAMP = 20.0  # verl's bound on |log ratio| before exp, relax's default
K3_CLAMP = 10.0  # verl's bound on the per-token k3 estimate, relax's default
DUAL_CLIP = 3.0  # verl's clip_ratio_c, relax's default


def assert_agrees(actual, expected, what: str):
    """relax (float32) against the reference (float64) to float32 rounding, relative to the largest value."""
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-6 * scale, msg=lambda m: f"{what}: {m}")


# --- random inputs ----------------------------------------------------------------------------------------------


class Batch:
    """Random responses grouped per prompt: ragged lengths, padded [N, T] float32 tensors whose padding is junk."""

    def __init__(self, seed: int, extreme: bool = True, log_ratio_scale: float = 0.3):
        rng = random.Random(seed)
        self.group_size = rng.randint(2, 8)
        self.num_groups = rng.randint(1, 4)
        n = self.group_size * self.num_groups
        self.lengths = [rng.randint(1, 20) for _ in range(n)]
        self.rewards = torch.tensor([r for _ in range(self.num_groups) for r in self._group_rewards(rng)])
        generator = torch.Generator().manual_seed(seed)
        width = max(self.lengths)
        self.mask = torch.tensor([[1.0 if t < length else 0.0 for t in range(width)] for length in self.lengths])

        def near(base):  # another policy's logprobs of the same tokens, some of them very far off
            values = base + log_ratio_scale * torch.randn(n, width, generator=generator)
            if extreme:
                wild = torch.rand(n, width, generator=generator) < 0.08
                picks = torch.randint(len(EXTREME_LOG_RATIOS), (n, width), generator=generator)
                values = torch.where(wild, base - torch.tensor(EXTREME_LOG_RATIOS)[picks], values)
            return values

        self.logprobs = -3.0 * torch.rand(n, width, generator=generator)
        self.old_logprobs = near(self.logprobs)
        self.ref_logprobs = near(self.logprobs)
        self.rollout_logprobs = near(self.old_logprobs)
        self.entropy = 2.0 * torch.rand(n, width, generator=generator)
        self.token_advantages = torch.randn(n, width, generator=generator)
        self.sequence_advantages = torch.randn(n, generator=generator)[:, None].expand(n, width)
        padded = ("logprobs", "old_logprobs", "ref_logprobs", "rollout_logprobs", "entropy")
        padded += ("token_advantages", "sequence_advantages")
        junk = 5.0 * torch.randn(len(padded), n, width, generator=generator)
        for k, name in enumerate(padded):
            setattr(self, name, torch.where(self.mask == 0, junk[k], getattr(self, name)))

    def _group_rewards(self, rng: random.Random) -> list[float]:
        kind = rng.choice(("continuous", "binary", "equal"))
        if kind == "equal":  # the float32 mean of float32 0.7s is not always 0.7: the advantage must still be 0
            return [0.7] * self.group_size
        if kind == "binary":
            rewards = [float(rng.random() < 0.5) for _ in range(self.group_size)]
            rewards[0] = 1.0 - rewards[-1]  # not all equal
            return rewards
        return [rng.uniform(-1.0, 1.0) for _ in range(self.group_size)]

    def rows(self, padded: torch.Tensor) -> list[torch.Tensor]:
        """Each response's own values, float64 (differentiable back to `padded`)."""
        return [padded[i, :length].double() for i, length in enumerate(self.lengths)]


# --- reference formulas -----------------------------------------------------------------------------------------


def reference_group_advantages(rewards: list[float], group_size: int, normalize_std: bool) -> list[float]:
    """GRPO (Shao et al., DeepSeekMath, arXiv:2402.03300, outcome supervision): A_i = (r_i - mean(r)) / std(r) over
    the responses to one prompt. Conventions: the std is the unbiased sample std and 1e-6 is added to it (verl's
    GRPO outcome advantage); Dr. GRPO (Liu et al., arXiv:2503.20783) drops the division by the std."""
    advantages = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / group_size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (group_size - 1))
        advantages += [(r - mean) / (std + 1e-6) if normalize_std else r - mean for r in group]
    return advantages


def reference_rloo_advantages(rewards: list[float], group_size: int) -> list[float]:
    """RLOO (Ahmadian et al., arXiv:2402.14740): A_i = r_i - (1 / (k - 1)) sum_{j != i} r_j within a prompt's k
    responses."""
    advantages = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        for i, reward in enumerate(group):
            others = [r for j, r in enumerate(group) if j != i]
            advantages.append(reward - sum(others) / len(others))
    return advantages


def reference_reinforce_plus_plus(
    rewards: list[float], lengths: list[int], group_size: int, kl=None, kl_coef=0.0, gamma=1.0
) -> list[list[float]]:
    """REINFORCE++ (Hu, arXiv:2501.03262): each token's reward is -kl_coef * KL_t, the last token's plus the outcome
    reward; a token's advantage is its discounted return sum_{s >= t} gamma^(s - t) reward_s, normalised over all
    response tokens of the batch (mean 0, std 1; unbiased std + 1e-8, as verl's masked whitening). With several
    responses per prompt the group's mean outcome reward is subtracted first (REINFORCE++-baseline)."""
    outcomes = list(rewards)
    if group_size > 1:
        for start in range(0, len(rewards), group_size):
            mean = sum(rewards[start : start + group_size]) / group_size
            for i in range(start, start + group_size):
                outcomes[i] = rewards[i] - mean
    returns = []
    for i, length in enumerate(lengths):
        token_rewards = [-kl_coef * kl[i][t] if kl is not None else 0.0 for t in range(length)]
        token_rewards[-1] += outcomes[i]
        running, sequence_returns = 0.0, [0.0] * length
        for t in reversed(range(length)):
            running = token_rewards[t] + gamma * running
            sequence_returns[t] = running
        returns.append(sequence_returns)
    every = [value for sequence in returns for value in sequence]
    mean = sum(every) / len(every)
    std = math.sqrt(sum((v - mean) ** 2 for v in every) / (len(every) - 1))
    return [[(v - mean) / (std + 1e-8) for v in sequence] for sequence in returns]


def reference_advantage_rows(estimator: str, batch: Batch, normalize_std: bool) -> list[list[float]]:
    """Each response's token advantages by estimator name. gspo and cispo use GRPO's advantages (their papers
    change the loss, not the advantage); only the GRPO family divides by the std."""
    rewards = batch.rewards.double().tolist()
    if estimator == "reinforce_plus_plus":
        return reference_reinforce_plus_plus(rewards, batch.lengths, batch.group_size)
    if estimator == "rloo":
        sequence = reference_rloo_advantages(rewards, batch.group_size)
    else:
        assert estimator in ("grpo", "gspo", "cispo"), f"no reference for estimator {estimator}"
        sequence = reference_group_advantages(rewards, batch.group_size, normalize_std)
    return [[value] * length for value, length in zip(sequence, batch.lengths)]


def reference_log_ratio_clamp(log_r: torch.Tensor, bound: float | None) -> torch.Tensor:
    """verl's convention: |log ratio| at most `bound` before exp; past it the ratio is constant (no gradient)."""
    return log_r if bound is None else torch.clamp(log_r, -bound, bound)


def reference_ppo_clip(ratio, advantage, clip_low, clip_high, dual_clip):
    """PPO's clipped surrogate as a loss (Schulman et al., arXiv:1707.06347): max(-A r, -A clip(r, 1 - eps_low,
    1 + eps_high)), with DAPO's decoupled eps_low / eps_high (clip-higher, arXiv:2503.14476); dual-clip (Ye et al.,
    arXiv:1912.09729): where A < 0, at most -A * c. Returns (loss, clipped, dual_clipped) per element."""
    unclipped = -advantage * ratio
    clipped = -advantage * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        dual_clipped = (advantage < 0) & (loss > -advantage * dual_clip)
        loss = torch.where(dual_clipped, -advantage * dual_clip, loss)
    return loss, clipped > unclipped, dual_clipped


def reference_policy_gradient_tokens(s: LossSettings, logprobs, old_logprobs, advantages):
    """One response's per-token policy-gradient loss, with the fraction-metric indicators (clipped, dual_clipped).

    - PPO, token ratio r_t = pi / pi_old.
    - CISPO (MiniMax-M1, arXiv:2506.13585): -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * log pi_t; relax clips
      both sides (the paper's lower bound is left loose) and clamps log r_t as PPO does.
    - GSPO (Zheng et al., arXiv:2507.18071): one ratio per sequence s = (pi(y) / pi_old(y))^(1 / |y|) =
      exp(mean_t log r_t), clipped as PPO clips, with the sequence's advantage; relax's conventions: its log is
      clamped as the token ratio's, dual-clip applies as to PPO. The sequence's loss is counted once per token,
      so the aggregation decides its weight (seq_mean_token_mean: GSPO's 1/G sum over sequences).
    """
    if s.ratio_level == "sequence":
        log_s = reference_log_ratio_clamp((logprobs - old_logprobs).mean(), s.log_ratio_clamp)
        loss, clipped, dual = reference_ppo_clip(log_s.exp(), advantages[0], s.clip_low, s.clip_high, s.dual_clip)
        n = len(logprobs)
        return loss.expand(n), clipped.expand(n), dual.expand(n)
    ratio = reference_log_ratio_clamp(logprobs - old_logprobs, s.log_ratio_clamp).exp()
    if s.loss_mode == "cispo":
        weight = torch.clamp(ratio.detach(), 1.0 - s.clip_low, 1.0 + s.clip_high)
        return -weight * advantages * logprobs, weight != ratio.detach(), None
    return reference_ppo_clip(ratio, advantages, s.clip_low, s.clip_high, s.dual_clip)


def reference_aggregate(rows: list[torch.Tensor], mode: str, norm_length: int) -> torch.Tensor:
    """Per-token values of every response to one scalar:
    token_mean: sum of all tokens / number of tokens (DAPO's token-level loss);
    seq_mean_token_mean: mean over responses of each one's token mean (GRPO's 1/G sum_i 1/|o_i| sum_t);
    seq_mean_token_sum: mean over responses of each one's token sum;
    seq_mean_token_sum_norm: mean over responses of each one's token sum / a constant length (Dr. GRPO)."""
    if mode == "token_mean":
        return sum(row.sum() for row in rows) / sum(len(row) for row in rows)
    if mode == "seq_mean_token_mean":
        return sum(row.mean() for row in rows) / len(rows)
    if mode == "seq_mean_token_sum":
        return sum(row.sum() for row in rows) / len(rows)
    assert mode == "seq_mean_token_sum_norm", f"no reference for aggregation {mode}"
    return sum(row.sum() / norm_length for row in rows) / len(rows)


def reference_kl(estimator: str, logprobs, ref_logprobs, log_ratio_clamp, k3_clamp):
    """Schulman's estimators of KL(pi || pi_ref) from tokens sampled from pi ("Approximating KL Divergence", 2020),
    with x = log(pi_ref / pi): k1 = -x, k2 = x^2 / 2, k3 = e^x - 1 - x; for k3 verl's low-variance-KL bounds:
    |x| <= log_ratio_clamp before exp, k3 <= k3_clamp."""
    x = ref_logprobs - logprobs
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x**2
    x = reference_log_ratio_clamp(x, log_ratio_clamp)
    k3 = x.exp() - 1.0 - x
    return k3 if k3_clamp is None else torch.clamp(k3, max=k3_clamp)


def reference_policy_loss(s: LossSettings, batch: Batch, logprobs, entropy, advantages, old_rows, weights=None):
    """The actor's objective: aggregate(pg_t * w_t) + kl_coef * aggregate(KL_t) - entropy_coef * aggregate(H_t),
    one aggregation for the three terms (verl's convention); w_t are the importance weights (1 without); the
    reference logprobs are the batch's; Dr. GRPO's constant length is s.norm_length, else the
    longest response's. Returns (loss, token-mean metrics)."""
    lp_rows, adv_rows = batch.rows(logprobs), batch.rows(advantages)
    norm_length = s.norm_length or max(batch.lengths)

    def token_mean(rows):
        return reference_aggregate(rows, "token_mean", norm_length)

    pg_rows, clipped, dual = [], [], []
    for i in range(len(lp_rows)):
        loss, clip_flags, dual_flags = reference_policy_gradient_tokens(s, lp_rows[i], old_rows[i], adv_rows[i])
        pg_rows.append(loss if weights is None else loss * weights[i])
        clipped.append(clip_flags.double())
        dual.append(None if dual_flags is None else dual_flags.double())
    loss = reference_aggregate(pg_rows, s.aggregation, norm_length)
    if s.kl_coef:
        kl_rows = [
            reference_kl(s.kl_estimator, lp, ref, s.log_ratio_clamp, s.k3_clamp)
            for lp, ref in zip(lp_rows, batch.rows(batch.ref_logprobs))
        ]
        loss = loss + s.kl_coef * reference_aggregate(kl_rows, s.aggregation, norm_length)
    if s.entropy_coef:
        loss = loss - s.entropy_coef * reference_aggregate(batch.rows(entropy), s.aggregation, norm_length)
    metrics = {
        "clip_fraction": token_mean(clipped),
        "ppo_kl": token_mean([old - lp.detach() for old, lp in zip(old_rows, lp_rows)]),  # k1 of KL(old || pi)
    }
    if dual[0] is not None:
        metrics["dual_clip_fraction"] = token_mean(dual)
    return loss, metrics


# --- advantages -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize_std", [True, False], ids=["std", "no-std (Dr. GRPO)"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_advantages_equal_the_reference(estimator, normalize_std):
    for seed in SEEDS:
        batch = Batch(seed)
        advantages = compute_advantages(estimator, batch.rewards, batch.mask, batch.group_size, normalize_std)
        expected = reference_advantage_rows(estimator, batch, normalize_std)
        for i, (row, length) in enumerate(zip(expected, batch.lengths)):
            assert_agrees(advantages[i, :length], row, f"{estimator} seed {seed} response {i}")
        assert (advantages[batch.mask == 0] == 0).all(), "padding gets no advantage"
        if estimator == "reinforce_plus_plus":
            continue  # (its whitening is over the whole batch: a group of equal rewards is not zero)
        for start in range(0, len(batch.lengths), batch.group_size):
            group = slice(start, start + batch.group_size)
            if len(set(batch.rewards[group].tolist())) == 1:
                assert (advantages[group] == 0).all(), f"{estimator} seed {seed}: a group of equal rewards"


def test_reinforce_plus_plus_with_a_kl_penalty_and_discount_equals_the_reference():
    for seed in SEEDS:
        batch = Batch(seed, extreme=False)
        kl = (batch.logprobs - batch.ref_logprobs) * batch.mask
        for group_size in (1, batch.group_size):
            advantages = compute_advantages(
                "reinforce_plus_plus", batch.rewards, batch.mask, group_size, kl=kl, kl_coef=0.05, gamma=0.9
            )
            expected = reference_reinforce_plus_plus(
                batch.rewards.double().tolist(), batch.lengths, group_size, kl.double().tolist(), 0.05, 0.9
            )
            for i, (row, length) in enumerate(zip(expected, batch.lengths)):
                assert_agrees(advantages[i, :length], row, f"seed {seed} group size {group_size} response {i}")


# --- losses -----------------------------------------------------------------------------------------------------

def test_default_bounds_are_verls():
    defaults = LossSettings()
    assert (defaults.log_ratio_clamp, defaults.k3_clamp, defaults.dual_clip) == (LOG_RATIO_CLAMP, K3_CLAMP, DUAL_CLIP)


PPO = dict(loss_mode="ppo")  # relax's defaults: dual-clip, log-ratio and k3 clamps on
PPO_WITHOUT_DUAL_CLIP = dict(loss_mode="ppo", dual_clip=None)  # the log-ratio clamp alone bounds a wild token
PPO_WITHOUT_BOUNDS = dict(loss_mode="ppo", dual_clip=None, log_ratio_clamp=None, k3_clamp=None)
CISPO = dict(loss_mode="cispo", dual_clip=None)
GSPO = dict(loss_mode="ppo", ratio_level="sequence", clip_low=3e-4, clip_high=4e-4)  # GSPO's published clip range
LOSSES = {
    "ppo": PPO,
    "ppo-no-dual-clip": PPO_WITHOUT_DUAL_CLIP,
    "ppo-unbounded": PPO_WITHOUT_BOUNDS,
    "cispo": CISPO,
    "gspo": GSPO,
}


def loss_case(name: str, aggregation: str, seed: int) -> tuple[LossSettings, Batch, torch.Tensor]:
    """Settings, a batch and its advantages for one case: clip bounds, KL estimator, coefficients drawn at random;
    wild log-ratios only where the clamps are on; GSPO gets log-ratios around its narrow clip range and one
    advantage per sequence."""
    rng = random.Random(seed)
    fields = dict(LOSSES[name], aggregation=aggregation)
    if name != "gspo":
        clip_low = rng.uniform(0.05, 0.3)
        fields.update(clip_low=clip_low, clip_high=clip_low + rng.uniform(0.0, 0.2))
    if rng.random() < 0.7:
        fields.update(kl_coef=rng.uniform(0.01, 0.5), kl_estimator=rng.choice(("k1", "k2", "k3")))
    if rng.random() < 0.7:
        fields.update(entropy_coef=rng.uniform(0.001, 0.1))
    if aggregation == "seq_mean_token_sum_norm" and rng.random() < 0.5:
        fields.update(norm_length=rng.randint(20, 40))
    settings = LossSettings(**fields)
    batch = Batch(
        seed,
        extreme=settings.log_ratio_clamp is not None,
        log_ratio_scale=1e-3 if name == "gspo" else 0.3,
    )
    return settings, batch, batch.sequence_advantages if name == "gspo" else batch.token_advantages


def relax_loss_and_gradients(settings, batch, advantages, **kwargs):
    logprobs = batch.logprobs.clone().requires_grad_()
    entropy = batch.entropy.clone().requires_grad_()
    loss, metrics = policy_loss(
        settings, logprobs, batch.old_logprobs, advantages, batch.mask, batch.ref_logprobs, entropy, **kwargs
    )
    loss.backward()
    return loss, metrics, logprobs.grad, entropy.grad


def reference_loss_and_gradients(settings, batch, advantages, old_logprobs=None, weights=None):
    logprobs = batch.logprobs.clone().requires_grad_()
    entropy = batch.entropy.clone().requires_grad_()
    old_rows = batch.rows(batch.old_logprobs if old_logprobs is None else old_logprobs)
    loss, metrics = reference_policy_loss(settings, batch, logprobs, entropy, advantages, old_rows, weights)
    loss.backward()
    return loss, metrics, logprobs.grad, entropy.grad


def assert_gradient_agrees(actual, expected, what):
    """A missing gradient is a zero one (a term the loss does not have)."""
    if expected is None:
        expected = torch.zeros_like(actual)
    if actual is None:
        actual = torch.zeros_like(expected)
    assert_agrees(actual, expected, what)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_policy_loss_and_gradients_equal_the_reference(name, aggregation):
    for seed in SEEDS:
        settings, batch, advantages = loss_case(name, aggregation, seed)
        what = f"{name} {aggregation} seed {seed}"
        loss, metrics, grad, entropy_grad = relax_loss_and_gradients(settings, batch, advantages)
        expected, expected_metrics, expected_grad, expected_entropy_grad = reference_loss_and_gradients(
            settings, batch, advantages
        )
        assert_agrees(loss, expected, f"{what}: loss")
        assert torch.isfinite(grad).all(), f"{what}: gradient not finite"
        assert_gradient_agrees(grad, expected_grad, f"{what}: d loss / d logprobs")
        assert_gradient_agrees(entropy_grad, expected_entropy_grad, f"{what}: d loss / d entropy")
        for key, value in expected_metrics.items():
            assert_agrees(metrics[key], value, f"{what}: {key}")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_add_up_to_the_reference_batch(aggregation):
    """The actor's way: each micro-batch padded to its own length, given the whole batch's denominator and token
    count; the micro-batch losses, gradients and token-mean metrics add up to the whole batch's reference."""
    for seed in SEEDS:
        settings, batch, advantages = loss_case("ppo", aggregation, seed)
        if aggregation == "seq_mean_token_sum_norm" and settings.norm_length is None:
            settings.norm_length = 20  # a fixed length, as the actor's (the longest response the engine may give)
        denominator = aggregation_denominator(batch.mask, aggregation, settings.norm_length)
        order = random.Random(seed).sample(range(len(batch.lengths)), len(batch.lengths))
        cut = len(order) // 2 or 1
        logprobs = batch.logprobs.clone().requires_grad_()
        total, metric_totals = 0.0, {}
        for picks in (order[:cut], order[cut:]):
            if not picks:
                continue
            width = max(batch.lengths[i] for i in picks)
            loss, metrics = policy_loss(
                settings,
                logprobs[picks, :width],
                batch.old_logprobs[picks, :width],
                advantages[picks, :width],
                batch.mask[picks, :width],
                batch.ref_logprobs[picks, :width],
                batch.entropy[picks, :width],
                denominator=denominator,
                num_tokens=batch.mask.sum(),
            )
            loss.backward()
            total = total + loss.detach()
            for key in ("clip_fraction", "dual_clip_fraction", "ppo_kl"):
                metric_totals[key] = metric_totals.get(key, 0.0) + metrics[key]
        expected, expected_metrics, expected_grad, _ = reference_loss_and_gradients(settings, batch, advantages)
        what = f"{aggregation} seed {seed}"
        assert_agrees(total, expected, f"{what}: loss")
        assert_gradient_agrees(logprobs.grad, expected_grad, f"{what}: d loss / d logprobs")
        for key, value in expected_metrics.items():
            assert_agrees(metric_totals[key], value, f"{what}: {key}")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("bounds", [(LOG_RATIO_CLAMP, K3_CLAMP), (None, None)], ids=["clamped", "unclamped"])
def test_kl_estimators_and_gradients_equal_the_reference(estimator, bounds):
    for seed in SEEDS:
        batch = Batch(seed, extreme=bounds[0] is not None)
        logprobs = batch.logprobs.clone().requires_grad_()
        kl = kl_divergence(logprobs, batch.ref_logprobs, estimator, *bounds)
        (kl * batch.mask).sum().backward()
        reference_logprobs = batch.logprobs.clone().requires_grad_()
        expected = [
            reference_kl(estimator, lp, ref, *bounds)
            for lp, ref in zip(batch.rows(reference_logprobs), batch.rows(batch.ref_logprobs))
        ]
        sum(row.sum() for row in expected).backward()
        for i, (row, length) in enumerate(zip(expected, batch.lengths)):
            assert_agrees(kl[i, :length], row.detach(), f"{estimator} seed {seed} response {i}")
        assert_agrees(logprobs.grad, reference_logprobs.grad, f"{estimator} seed {seed}: gradient")


# --- rollout-training mismatch: metrics, TIS, MIS ---------------------------------------------------------------


def reference_mismatch(batch: Batch) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Per response, log(pi_old / pi_rollout) with the log-ratio clamp, and the mismatch metrics: |delta logprob|
    mean and max, k3 estimate of KL(pi_rollout || pi_old) (tokens sampled by the rollout: r - 1 - log r with
    r = pi_old / pi_rollout), the ratio's mean, min, max and the fraction of tokens outside [0.5, 2]."""
    old, rollout = batch.rows(batch.old_logprobs), batch.rows(batch.rollout_logprobs)
    log_ratios = [reference_log_ratio_clamp(o - r, LOG_RATIO_CLAMP) for o, r in zip(old, rollout)]
    deltas = torch.cat([(o - r).abs() for o, r in zip(old, rollout)])
    every = torch.cat(log_ratios)
    ratios = every.exp()
    return log_ratios, {
        "mismatch/logprob_abs_diff_mean": deltas.mean().item(),
        "mismatch/logprob_abs_diff_max": deltas.max().item(),
        "mismatch/k3_kl": (ratios - 1.0 - every).mean().item(),
        "mismatch/ratio_mean": ratios.mean().item(),
        "mismatch/ratio_min": ratios.min().item(),
        "mismatch/ratio_max": ratios.max().item(),
        "mismatch/ratio_outside_0.5_2_fraction": ((ratios < 0.5) | (ratios > 2.0)).double().mean().item(),
    }


def reference_importance_weights(correction: RolloutCorrection, log_ratios):
    """TIS (Yao et al., "Your efficient RL framework secretly brings you off-policy RL training", 2025; slime's
    --use-tis): each token weighted by min(max(r_t, low), C). MIS (verl's sequence-level rejection sampling with the
    geometric mean): a response whose exp(mean_t log r_t) leaves [low, high] weighs 0. Also the fractions of
    tokens truncated and masked."""
    weights, truncated, masked = [], [], []
    for log_r in log_ratios:
        ratio = log_r.exp()
        w = torch.ones_like(ratio)
        if correction.tis_clip is not None:
            w = torch.clamp(ratio, correction.tis_clip_low, correction.tis_clip)
            truncated.append((w != ratio).double())
        if correction.mis_bounds is not None:
            low, high = correction.mis_bounds
            kept = low <= log_r.mean().exp().item() <= high
            w = w if kept else torch.zeros_like(w)
            masked.append(torch.full_like(ratio, 0.0 if kept else 1.0))
        weights.append(w)
    metrics = {}
    if truncated:
        metrics["mismatch/tis_clip_fraction"] = torch.cat(truncated).mean().item()
    if masked:
        metrics["mismatch/mis_masked_fraction"] = torch.cat(masked).mean().item()
    return weights, metrics


CORRECTIONS = {
    "none": RolloutCorrection(),
    "tis": RolloutCorrection(tis_clip=2.0),
    "tis-floor": RolloutCorrection(tis_clip=1.5, tis_clip_low=0.5),
    "mis": RolloutCorrection(mis_bounds=(0.9, 1.1)),
    "tis+mis": RolloutCorrection(tis_clip=2.0, mis_bounds=(0.5, 2.0)),
    "rollout-as-old": RolloutCorrection(use_rollout_logprobs=True),
}


@pytest.mark.parametrize("name", CORRECTIONS)
def test_corrected_policy_loss_and_mismatch_metrics_equal_the_reference(name):
    correction = CORRECTIONS[name]
    for seed in SEEDS:
        settings, batch, advantages = loss_case("ppo", random.Random(seed).choice(AGGREGATIONS), seed)
        logprobs = batch.logprobs.clone().requires_grad_()
        entropy = batch.entropy.clone().requires_grad_()
        loss, metrics = corrected_policy_loss(
            settings,
            correction,
            logprobs,
            advantages,
            batch.mask,
            batch.old_logprobs,
            batch.rollout_logprobs,
            batch.ref_logprobs,
            entropy,
        )
        loss.backward()

        log_ratios, expected_metrics = reference_mismatch(batch)
        weights, correction_metrics = reference_importance_weights(correction, log_ratios)
        old_logprobs = batch.rollout_logprobs if correction.use_rollout_logprobs else batch.old_logprobs
        expected, loss_metrics, expected_grad, expected_entropy_grad = reference_loss_and_gradients(
            settings, batch, advantages, old_logprobs, weights
        )

        what = f"{name} {settings.aggregation} seed {seed}"
        assert_agrees(loss, expected, f"{what}: loss")
        assert_gradient_agrees(logprobs.grad, expected_grad, f"{what}: d loss / d logprobs")
        assert_gradient_agrees(entropy.grad, expected_entropy_grad, f"{what}: d loss / d entropy")
        for key, value in {**expected_metrics, **correction_metrics, **loss_metrics}.items():
            assert_agrees(metrics[key], value, f"{what}: {key}")
        if name != "none":
            assert set(correction_metrics) <= set(metrics)


def test_mismatch_metrics_of_identical_logprobs_are_zero_gaps():
    batch = Batch(0)
    metrics = mismatch_metrics(batch.old_logprobs, batch.old_logprobs.clone(), batch.mask)
    for key in ("logprob_abs_diff_mean", "logprob_abs_diff_max", "k3_kl", "ratio_outside_0.5_2_fraction"):
        assert metrics[f"mismatch/{key}"] == 0.0
    for key in ("ratio_mean", "ratio_min", "ratio_max"):
        assert metrics[f"mismatch/{key}"] == 1.0


# --- overlong penalty -------------------------------------------------------------------------------------------


def reference_overlong_penalty(length: int, max_length: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al., arXiv:2503.14476, eq. 13), scaled by verl's
    overlong_penalty_factor: 0 for |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache up to L_max, -1
    beyond."""
    if length <= max_length - buffer:
        return 0.0
    if length <= max_length:
        return factor * ((max_length - buffer) - length) / buffer
    return -factor


def test_overlong_penalty_equals_the_reference():
    rng = random.Random(0)
    for _ in range(500):
        max_length = rng.randint(1, 64)
        buffer = rng.randint(1, max_length)
        factor = rng.choice((1.0, 0.5, rng.uniform(0.0, 2.0)))
        length = rng.randint(0, max_length + 4)
        expected = reference_overlong_penalty(length, max_length, buffer, factor)
        assert overlong_penalty(length, max_length, buffer, factor) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    prompt = Prompt(row=1, token_ids=[1], text="p")
    lengths = [rng.randint(1, 24) for _ in range(40)]
    samples = [Sample(prompt, [5] * n, [0.0] * n, "stop", reward=rng.random()) for n in lengths]
    rewards = [s.reward for s in samples]
    apply_overlong_penalty(samples, 20, 6, penalty_factor=0.7)
    for sample, reward, length in zip(samples, rewards, lengths):
        assert sample.reward == pytest.approx(reward + reference_overlong_penalty(length, 20, 6, 0.7), abs=1e-12)
