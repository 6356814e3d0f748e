"""relax.train.losses against values computed by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from relax.train.losses import (
    LossSettings,
    aggregate,
    aggregation_denominator,
    cispo_policy_loss,
    clipped_policy_loss,
    kl_divergence,
    log_ratio,
    policy_loss,
)

LN2 = math.log(2.0)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), torch.tensor(expected), atol=atol, rtol=0)


# Row 0 has 3 response tokens (1, 2, 3), row 1 one token (4); 100 and -100 are padding and must not count.
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -100.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, norm_length, expected",
    [
        ("token_mean", None, 2.5),  # (1 + 2 + 3 + 4) / 4
        ("seq_mean_token_mean", None, 3.0),  # (6/3 + 4/1) / 2
        ("seq_mean_token_sum", None, 5.0),  # (6 + 4) / 2
        ("seq_mean_token_sum_norm", None, 10 / 6),  # 10 / (2 rows * 3 padded length)
        ("seq_mean_token_sum_norm", 5, 1.0),  # 10 / (2 rows * 5)
    ],
)
def test_aggregation_modes(mode, norm_length, expected):
    close(aggregate(VALUES, MASK, mode, norm_length), expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_micro_batches_with_the_batch_denominator_add_up_to_the_batch(mode):
    denominator = aggregation_denominator(MASK, mode)
    parts = [aggregate(VALUES[i : i + 1], MASK[i : i + 1], mode, denominator=denominator) for i in range(2)]
    close(sum(parts), aggregate(VALUES, MASK, mode).item())


def test_unknown_aggregation_lists_the_choices():
    with pytest.raises(ValueError, match="seq_mean_token_mean"):
        aggregate(VALUES, MASK, "sequence_mean")


def test_asymmetric_clip():
    # clip_low 0.2, clip_high 0.28: ratios are clamped to [0.8, 1.28].
    ratios = torch.tensor([1.5, 0.5, 1.1, 0.7])
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped, _ = clipped_policy_loss(ratios.log(), advantages, clip_low=0.2, clip_high=0.28)
    # r=1.5, A=+1: max(-1.5, -1.28) = -1.28, clipped.   r=0.5, A=+1: max(-0.5, -0.8) = -0.5.
    # r=1.1, A=-1: max(1.1, 1.1) = 1.1, not clipped.    r=0.7, A=-1: max(0.7, 0.8) = 0.8, clipped.
    close(loss, [-1.28, -0.5, 1.1, 0.8])
    close(clipped, [1.0, 0.0, 0.0, 1.0])


def test_dual_clip_bounds_negative_advantage_tokens():
    ratios = torch.tensor([4.0, 2.0, 4.0], requires_grad=True)
    advantages = torch.tensor([-1.0, -1.0, 1.0])
    loss, clipped, dual_clipped = clipped_policy_loss(ratios.log(), advantages, 0.2, 0.28, dual_clip=3.0)
    # r=4, A=-1: max(4, 1.28) = 4, bounded by -A * 3 = 3.   r=2, A=-1: 2 < 3 stays.
    # r=4, A=+1: max(-4, -1.28) = -1.28 (dual-clip acts on negative advantages only).
    close(loss.detach(), [3.0, 2.0, -1.28])
    close(clipped, [0.0, 0.0, 1.0])
    close(dual_clipped, [1.0, 0.0, 0.0])
    loss.sum().backward()
    close(ratios.grad, [0.0, 1.0, 0.0])  # the bounded token pushes no more


@pytest.mark.parametrize("log_r, advantage, expected", [(89.0, -1.0, 3.0), (50.0, -1.0, 3.0), (50.0, 1.0, -1.28)])
def test_wild_log_ratios_give_a_bounded_loss_and_a_finite_gradient(log_r, advantage, expected):
    # Unclamped, exp(89) is inf in float32 (a NaN gradient) and exp(50) * 0.5 a loss of 2.6e21. By default the
    # log-ratio is clamped at 20 and dual-clip bounds a negative-advantage token's loss at -A * 3.
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), log_r, requires_grad=True)
    loss, _ = policy_loss(LossSettings(), new, old, torch.tensor([[advantage]]), torch.ones(1, 1))
    loss.backward()
    close(loss.detach(), expected)
    close(new.grad, [[0.0]])
    # Dual-clip off: e^20 * 1, large and finite
    loss, _ = policy_loss(LossSettings(dual_clip=None), new, old, torch.tensor([[-1.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_k3_is_clamped_and_exact_near_zero():
    logprobs, ref = torch.tensor([-15.0, -89.0, 1e-4]), torch.zeros(3)
    # log(pi/ref) = -15: k3 = e^15 - 1 - 15 = 3.27e6 -> 10; -89 (e^89 is inf in float32): clamped to -20, then 10
    close(kl_divergence(logprobs, ref, "k3", log_ratio_clamp=20.0, k3_clamp=10.0)[:2], [10.0, 10.0])
    unclamped = kl_divergence(logprobs[:1], ref[:1], "k3")
    assert unclamped.item() == pytest.approx(math.exp(15.0) - 16.0, rel=1e-6)
    # log(pi/ref) = 1e-4: k3 = e^-x - 1 + x = x^2 / 2 - x^3 / 6 = 4.99983e-9; exp(-x) - 1 in float32 rounds
    # to steps of 6e-8 around 1
    x = float(torch.tensor(1e-4))
    assert kl_divergence(logprobs, ref, "k3")[2].item() == pytest.approx(math.expm1(-x) + x, rel=2e-3)


def test_cispo_caps_the_weight_and_keeps_the_gradient_of_clipped_tokens():
    # The same ratios, clamped to [0.8, 1.28] under a stop-gradient: weights 1.28, 0.8, 1.1, 0.8.
    ratios = torch.tensor([1.5, 0.5, 1.1, 0.7])
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    loss, clipped = cispo_policy_loss(
        ratios.log() + logprobs - logprobs.detach(), logprobs, advantages, clip_low=0.2, clip_high=0.28
    )
    # -w * A * log pi: -1.28 * -1 = 1.28; -0.8 * -2 = 1.6; -1.1 * -1 * -0.5 = -0.55; -0.8 * -1 * -3 = -2.4
    close(loss.detach(), [1.28, 1.6, -0.55, -2.4])
    close(clipped, [1.0, 1.0, 0.0, 1.0])
    loss.sum().backward()
    close(logprobs.grad, [-1.28, -0.8, 1.1, 0.8])  # -w * A: every token keeps a gradient, PPO's clip cuts three


def test_policy_loss_cispo_mode():
    new, old, advantages, mask, _, _ = _batch()
    _, metrics = policy_loss(LossSettings(loss_mode="cispo"), new, old, advantages, mask)
    # weights 1.28, 0.8 | 0.8 (ratios 1.5, 0.5 | 0.7 clamped to [0.8, 1.28]); -w * A * log pi, token mean
    expected = (-1.28 * math.log(0.6) - 0.8 * math.log(0.2) + 0.8 * math.log(0.28)) / 3
    close(metrics["pg_loss"], expected)
    close(metrics["clip_fraction"], 3 / 3)


def test_token_weights_scale_only_the_policy_gradient_term():
    new, old, advantages, mask, ref, _ = _batch()
    settings = LossSettings(kl_coef=0.1, kl_estimator="k1")
    weights = torch.tensor([[2.0, 0.0], [0.5, 7.0]])
    _, metrics = policy_loss(settings, new, old, advantages, mask, ref, token_weights=weights)
    close(metrics["pg_loss"], (-1.28 * 2 + 0.8 * 0.5) / 3)  # per-token pg -1.28, -0.5 | 0.8, weighted
    close(metrics["kl"], LN2 / 3)  # unweighted


def test_kl_estimators():
    # log(pi/ref) = +ln2 (pi=0.5, ref=0.25) and -ln2 (pi=0.25, ref=0.5).
    logprobs = torch.tensor([0.5, 0.25]).log()
    ref = torch.tensor([0.25, 0.5]).log()
    close(kl_divergence(logprobs, ref, "k1"), [LN2, -LN2])
    close(kl_divergence(logprobs, ref, "k2"), [0.5 * LN2**2, 0.5 * LN2**2])  # 0.240227
    # k3 = ref/pi - 1 - log(ref/pi): 0.5 - 1 + ln2 = 0.193147;  2 - 1 - ln2 = 0.306853
    close(kl_divergence(logprobs, ref, "k3"), [0.5 - 1 + LN2, 2 - 1 - LN2])


def test_gspo_sequence_ratio_value_and_per_token_gradient():
    logprobs = torch.tensor([[LN2, 0.0, 5.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]])
    seq = log_ratio(logprobs, old, mask, "sequence")
    # s = exp(mean(ln2, 0)) = sqrt(2): every token carries log s = ln2 / 2.
    close(seq.detach(), [[LN2 / 2] * 3])
    seq[0, 1].backward()
    close(logprobs.grad, [[0.0, 1.0, 0.0]])  # the gradient still reaches only that token's logprob
    close(log_ratio(logprobs, old, mask, "token").detach(), [[LN2, 0.0, 5.0]])


def _batch():
    # old pi = 0.4 everywhere; new pi = 0.6, 0.2 | 0.28 -> ratios 1.5, 0.5 | 0.7 (row 1 has one token).
    old = torch.tensor([[0.4, 0.4], [0.4, 0.4]]).log()
    new = torch.tensor([[0.6, 0.2], [0.28, 0.9]]).log()
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    ref = torch.tensor([[0.3, 0.4], [0.14, 0.1]]).log()  # log(new/ref) = ln2, -ln2 | ln2
    entropy = torch.tensor([[1.0, 2.0], [3.0, 9.0]])
    return new, old, advantages, mask, ref, entropy


def test_policy_loss_token_mean_with_kl_and_entropy():
    new, old, advantages, mask, ref, entropy = _batch()
    settings = LossSettings(clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, metrics = policy_loss(settings, new, old, advantages, mask, ref, entropy)
    # per-token pg: -1.28, -0.5 | 0.8  -> token mean -0.98 / 3
    close(metrics["pg_loss"], -0.98 / 3)
    close(metrics["clip_fraction"], 2 / 3)
    # ppo_kl = mean(old - new) = (-ln1.5 + ln2 + ln(1/0.7)) / 3
    close(metrics["ppo_kl"], (-math.log(1.5) + LN2 - math.log(0.7)) / 3)
    close(metrics["kl"], LN2 / 3)  # (ln2 - ln2 + ln2) / 3
    close(metrics["entropy"], 2.0)  # (1 + 2 + 3) / 3
    close(loss.detach(), -0.98 / 3 + 0.1 * LN2 / 3 - 0.01 * 2.0)  # -0.3235618
    close(metrics["loss"], loss.item())


def test_policy_loss_sequence_mean_token_mean():
    new, old, advantages, mask, _, _ = _batch()
    _, metrics = policy_loss(LossSettings(aggregation="seq_mean_token_mean"), new, old, advantages, mask)
    close(metrics["pg_loss"], ((-1.28 - 0.5) / 2 + 0.8) / 2)  # -0.045


def test_policy_loss_gradient_is_cut_where_clipped():
    new, old, advantages, mask, _, _ = _batch()
    new = new.clone().requires_grad_(True)
    loss, _ = policy_loss(LossSettings(), new, old, advantages, mask)
    loss.backward()
    # d/dlogp of -A*r/3 = -A*r/3 where unclipped (token 0,1: -0.5/3), 0 where clipped or padding.
    close(new.grad, [[0.0, -0.5 / 3], [0.0, 0.0]])


def test_policy_loss_micro_batches_add_up():
    new, old, advantages, mask, ref, entropy = _batch()
    settings = LossSettings(kl_coef=0.1, entropy_coef=0.01)
    _, whole = policy_loss(settings, new, old, advantages, mask, ref, entropy)
    denominator, num_tokens = aggregation_denominator(mask, settings.aggregation), mask.sum()
    parts = [
        policy_loss(settings, *(t[i : i + 1] for t in (new, old, advantages, mask, ref, entropy)),
                    denominator=denominator, num_tokens=num_tokens)[1]
        for i in range(2)
    ]
    for key, value in whole.items():
        close(sum(p[key] for p in parts), value.item())


def test_policy_loss_refuses_kl_without_reference():
    new, old, advantages, mask, _, _ = _batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(LossSettings(kl_coef=0.1), new, old, advantages, mask)


def test_loss_settings_validate_names():
    with pytest.raises(ValueError, match="k3"):
        LossSettings(kl_estimator="k4")
    with pytest.raises(ValueError, match="sequence"):
        LossSettings(ratio_level="seq")
    with pytest.raises(ValueError, match="cispo"):
        LossSettings(loss_mode="grpo")
    with pytest.raises(ValueError, match="ratio_level='token'"):
        LossSettings(loss_mode="cispo", ratio_level="sequence")
    with pytest.raises(ValueError, match="dual_clip .* must be > 1, got 1.0"):
        LossSettings(dual_clip=1.0)
    with pytest.raises(ValueError, match="k3_clamp must be > 0"):
        LossSettings(k3_clamp=0.0)
