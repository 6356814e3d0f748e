"""relax.train.off_policy against values computed by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from relax.train.losses import LossSettings
from relax.train.off_policy import (
    RolloutCorrection,
    corrected_policy_loss,
    importance_weights,
    mis_keep,
    mismatch_metrics,
    rollout_log_ratio,
    tis_weights,
)

LN4, LN1_5 = math.log(4.0), math.log(1.5)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), torch.tensor(expected), atol=atol, rtol=0)


# Row 0 has three response tokens whose ratios pi_old / pi_rollout are 1, 4 and 1/4; row 1 one token of ratio 1.5.
# The padding (old 50, rollout 0) must count nowhere.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
ROLLOUT = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, 0.0, 0.0]])
OLD = ROLLOUT + torch.tensor([[0.0, LN4, -LN4], [LN1_5, 50.0, 50.0]])


def test_mismatch_metrics():
    metrics = mismatch_metrics(OLD, ROLLOUT, MASK)
    close(metrics["mismatch/logprob_abs_diff_mean"], (2 * LN4 + LN1_5) / 4)  # (0 + ln4 + ln4 + ln1.5) / 4
    close(metrics["mismatch/logprob_abs_diff_max"], LN4)
    # k3 = r - 1 - ln r: 0, 3 - ln4, -0.75 + ln4, 0.5 - ln1.5
    close(metrics["mismatch/k3_kl"], (3 - 0.75 + 0.5 - LN1_5) / 4)
    close(metrics["mismatch/ratio_mean"], (1 + 4 + 0.25 + 1.5) / 4)
    close(metrics["mismatch/ratio_min"], 0.25)
    close(metrics["mismatch/ratio_max"], 4.0)
    close(metrics["mismatch/ratio_outside_0.5_2_fraction"], 2 / 4)  # 4 and 1/4


def test_mismatch_metrics_of_micro_batches_combine_into_the_batch():
    whole = mismatch_metrics(OLD, ROLLOUT, MASK)
    parts = [mismatch_metrics(OLD[i : i + 1], ROLLOUT[i : i + 1], MASK[i : i + 1], num_tokens=4) for i in range(2)]
    for key, value in whole.items():
        values = torch.stack([part[key] for part in parts])
        combined = values.max() if key.endswith("_max") else values.min() if key.endswith("_min") else values.sum()
        close(combined, value.item())


def test_k3_of_a_float32_rounding_sized_gap_is_not_noise():
    gap = torch.tensor([[1.5e-7, -1.5e-7]])  # exp(1.5e-7) - 1 rounds to 1.19e-7 in float32: r - 1 - log r < 0
    k3 = mismatch_metrics(gap, torch.zeros(1, 2), torch.ones(1, 2))["mismatch/k3_kl"].item()
    assert 0.0 <= k3 <= 1e-13  # the true value is gap^2 / 2 = 1.1e-14


def test_a_wild_token_gives_a_large_finite_ratio():
    old, rollout = torch.tensor([[0.0]]), torch.tensor([[-500.0]])
    assert rollout_log_ratio(old, rollout).item() == 20.0
    assert mismatch_metrics(old, rollout, torch.ones(1, 1))["mismatch/ratio_max"].item() == pytest.approx(math.exp(20))


def test_tis_weights_are_the_ratio_clamped():
    log_ratio = rollout_log_ratio(OLD, ROLLOUT)
    weights, truncated = tis_weights(log_ratio, clip=2.0)
    close(weights[0], [1.0, 2.0, 0.25])  # 4 capped at 2
    close(weights[1, 0], 1.5)
    close(truncated * MASK, [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    weights, _ = tis_weights(log_ratio, clip=2.0, clip_low=0.5)
    close(weights[0], [1.0, 2.0, 0.5])  # 1/4 raised to 0.5


def test_mis_keeps_sequences_by_their_geometric_mean_ratio():
    log_ratio = rollout_log_ratio(OLD, ROLLOUT)
    # row 0: exp((0 + ln4 - ln4) / 3) = 1, kept although two of its tokens are 4x off; row 1: 1.5
    assert mis_keep(log_ratio, MASK, 0.8, 1.25).tolist() == [True, False]
    assert mis_keep(log_ratio, MASK, 0.5, 2.0).tolist() == [True, True]


def test_importance_weights_combine_tis_and_mis():
    correction = RolloutCorrection(tis_clip=2.0, mis_bounds=(0.8, 1.25))
    weights, metrics = importance_weights(correction, OLD, ROLLOUT, MASK)
    close(weights * MASK, [[1.0, 2.0, 0.25], [0.0, 0.0, 0.0]])
    close(metrics["mismatch/tis_clip_fraction"], 1 / 4)
    close(metrics["mismatch/mis_masked_fraction"], 1 / 4)  # row 1's one token of four
    assert importance_weights(RolloutCorrection(), OLD, ROLLOUT, MASK) == (None, {})


# The policy's logprobs equal the actor's old ones (ratio 1, nothing clipped) and every advantage is 1, so each
# token's PPO term is -1 before the correction weighs it.
ADVANTAGES = torch.ones(2, 3)


@pytest.mark.parametrize(
    "correction, expected_loss, expected_grad",
    [
        (RolloutCorrection(), -1.0, [[-0.25] * 3, [-0.25, 0, 0]]),  # -(1 + 1 + 1 + 1) / 4 tokens
        # -(1 + 2 + 0.25 + 1.5) / 4; d/dlogp of -w * exp(logp - old) / 4 at ratio 1 is -w / 4
        (RolloutCorrection(tis_clip=2.0), -4.75 / 4, [[-0.25, -0.5, -0.0625], [-0.375, 0, 0]]),
        (RolloutCorrection(mis_bounds=(0.8, 1.25)), -0.75, [[-0.25] * 3, [0.0, 0, 0]]),  # row 1 dropped
        # PPO against the rollout: ratios 1, 4, 1/4, 1.5 clipped to [0.8, 1.28]: -(1 + 1.28 + 0.25 + 1.28) / 4;
        # the gradient reaches only unclipped tokens: -r / 4 for r = 1 and 1/4
        (RolloutCorrection(use_rollout_logprobs=True), -3.81 / 4, [[-0.25, 0.0, -0.0625], [0.0, 0, 0]]),
    ],
)
def test_corrected_policy_loss(correction, expected_loss, expected_grad):
    logprobs = OLD.clone().requires_grad_()
    loss, metrics = corrected_policy_loss(
        LossSettings(), correction, logprobs, ADVANTAGES, MASK, old_logprobs=OLD, rollout_logprobs=ROLLOUT
    )
    loss.backward()
    close(loss.detach(), expected_loss)
    close(logprobs.grad, expected_grad)
    close(metrics["mismatch/ratio_max"], 4.0)  # the mismatch metrics come with every correction


def test_without_old_logprobs_the_current_ones_are_the_old_policy():
    logprobs = OLD.clone().requires_grad_()
    with_old = corrected_policy_loss(LossSettings(), RolloutCorrection(), logprobs, ADVANTAGES, MASK, OLD, ROLLOUT)
    without = corrected_policy_loss(LossSettings(), RolloutCorrection(), logprobs, ADVANTAGES, MASK, None, ROLLOUT)
    close(without[0].detach(), with_old[0].item())
    assert {k: v.item() for k, v in without[1].items()} == pytest.approx({k: v.item() for k, v in with_old[1].items()})


def test_a_correction_without_rollout_logprobs_is_refused():
    with pytest.raises(ValueError, match="rollout logprobs"):
        corrected_policy_loss(LossSettings(), RolloutCorrection(tis_clip=2.0), OLD, ADVANTAGES, MASK, OLD)
    loss, metrics = corrected_policy_loss(LossSettings(), RolloutCorrection(), OLD, ADVANTAGES, MASK, OLD)
    assert loss.item() == -1.0 and not any(key.startswith("mismatch/") for key in metrics)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(tis_clip=0.0), "tis_clip > 0"),
        (dict(tis_clip=1.0, tis_clip_low=2.0), "tis_clip_low <= tis_clip"),
        (dict(mis_bounds=(1.1, 2.0)), "0 < low <= 1 <= high"),
        (dict(mis_bounds=(1.0, 1.0)), "low < high"),
        (dict(tis_clip=2.0, use_rollout_logprobs=True), "exclude each other"),
    ],
)
def test_bad_corrections_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrection(**fields)


@pytest.mark.parametrize("correction", [RolloutCorrection(), RolloutCorrection(tis_clip=2.0, mis_bounds=(0.5, 2.0))])
def test_a_token_masked_out_of_the_loss_counts_nowhere(correction):
    """A multi-turn sample's appended ids (a tool's output: loss mask 0, rollout logprob 0.0, any logprob under the
    policy) change neither the loss and its gradient nor the KL, entropy and mismatch metrics: the same row without
    them gives the same values."""
    settings = LossSettings(kl_coef=0.1, entropy_coef=0.01)

    def loss_of(keep: list[int], mask: list[float]):
        logprobs = torch.tensor([[-1.0, -7.0, -0.5]])[:, keep].requires_grad_()
        values = {  # old, rollout, ref, entropy, advantage
            "old": torch.tensor([[-1.2, -3.0, -0.4]]), "rollout": torch.tensor([[-1.1, 0.0, -0.6]]),
            "ref": torch.tensor([[-0.9, -9.0, -0.5]]), "entropy": torch.tensor([[1.0, 5.0, 2.0]]),
            "advantages": torch.tensor([[0.5, 0.5, 0.5]]),
        }
        values = {name: value[:, keep] for name, value in values.items()}
        loss, metrics = corrected_policy_loss(
            settings, correction, logprobs, values["advantages"], torch.tensor([mask]), old_logprobs=values["old"],
            rollout_logprobs=values["rollout"], ref_logprobs=values["ref"], entropy=values["entropy"],
        )
        loss.backward()
        return loss.item(), logprobs.grad[0, [0, -1]], {name: value.item() for name, value in metrics.items()}

    masked_loss, masked_grad, masked_metrics = loss_of([0, 1, 2], [1.0, 0.0, 1.0])
    loss, grad, metrics = loss_of([0, 2], [1.0, 1.0])
    assert masked_loss == pytest.approx(loss)
    close(masked_grad, grad.tolist())
    assert masked_metrics == pytest.approx(metrics)
    assert {"kl", "entropy", "mismatch/ratio_max", "mismatch/logprob_abs_diff_mean"} <= set(metrics)
