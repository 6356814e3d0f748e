"""relax.train.advantages against values computed by hand (the arithmetic is in the comments)."""

import pytest
import torch

from relax.train.advantages import (
    grpo_sequence_advantages,
    reinforce_plus_plus_advantages,
    rloo_sequence_advantages,
)
from relax.train.algorithms import compute_advantages


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual.float(), torch.tensor(expected), atol=atol, rtol=0)


REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])  # two prompts, four responses each


def test_grpo_group_normalised():
    # group 1: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.866025
    # group 2: mean 0.75, sample std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5 -> 0.5, 0.5, 0.5, -1.5
    close(
        grpo_sequence_advantages(REWARDS, group_size=4),
        [0.866025, -0.866025, -0.866025, 0.866025, 0.5, 0.5, 0.5, -1.5],
    )


def test_grpo_without_std_and_equal_rewards():
    close(
        grpo_sequence_advantages(REWARDS, group_size=4, normalize_std=False),
        [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75],
    )
    close(grpo_sequence_advantages(torch.tensor([1.0, 1.0]), group_size=2), [0.0, 0.0])



def test_grpo_equal_rewards_are_exactly_zero_in_float32():
    # The float32 mean of eight 0.7s is not 0.7: its rounding divided by a std as small gave +0.056.
    rewards = torch.tensor([0.7] * 8 + [0.1, 0.3, 0.3, 0.1, 0.2, 0.2, 0.2, 0.2], dtype=torch.float32)
    advantages = grpo_sequence_advantages(rewards, group_size=8)
    assert advantages[:8].tolist() == [0.0] * 8
    # group 2: mean 0.2, sample std sqrt(4 * 0.01 / 7) = 0.0755929 -> -+0.1 / (0.0755929 + eps 1e-6), 0 for 0.2
    a = 0.1 / (0.0755929 + 1e-6)
    close(advantages[8:], [-a, a, a, -a, 0.0, 0.0, 0.0, 0.0])


def test_rloo_and_reinforce_plus_plus_equal_rewards_are_exactly_zero_in_float32():
    # RLOO: 0.7 - (7 x 0.7) / 7 rounded to 6e-8; REINFORCE++ without groups: eight equal returns 0.7 whitened as
    # (0.7 - their float32 mean) / (a std of rounding + 1e-8) gave -0.84 on every token
    rewards, mask = torch.tensor([0.7] * 8), torch.ones(8, 3)
    assert rloo_sequence_advantages(rewards, group_size=8).tolist() == [0.0] * 8
    for group_size in (1, 8):
        advantages = reinforce_plus_plus_advantages(rewards, mask, group_size)
        assert advantages.tolist() == [[0.0] * 3] * 8, f"group_size={group_size}"


def test_rloo_leave_one_out():
    # r=1: 1 - mean(0, 0, 1) = 2/3;  r=0: 0 - mean(1, 0, 1) = -2/3.  group 2: 1 - 2/3 = 1/3, 0 - 1 = -1
    close(
        rloo_sequence_advantages(REWARDS, group_size=4),
        [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0],
    )


def test_sequence_advantages_spread_over_response_tokens():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    advantages = compute_advantages("gspo", torch.tensor([1.0, 0.0]), mask, group_size=2)
    # mean 0.5, sample std 0.707107 -> +-0.707107, zero on padding
    close(advantages, [[0.707107] * 3, [-0.707107, 0.0, 0.0]])
    torch.testing.assert_close(advantages, compute_advantages("grpo", torch.tensor([1.0, 0.0]), mask, 2))


def test_reinforce_plus_plus_batch_normalised_returns():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # returns 1, 1, 1 | 0, 0; mean 0.6, sample std sqrt((3 * 0.16 + 2 * 0.36) / 4) = 0.547723
    close(
        reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), mask),
        [[0.730297] * 3, [-1.095445, -1.095445, 0.0]],
    )


def test_reinforce_plus_plus_with_kl_penalty():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])
    # token rewards -0.1, -0.2, 1-0.3 | -0.5, -0.5 -> returns 0.4, 0.5, 0.7 | -1.0, -0.5
    # mean 0.02; sample std sqrt((0.38^2 + 0.48^2 + 0.68^2 + 1.02^2 + 0.52^2) / 4) = sqrt(0.537) = 0.732803
    close(
        reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), mask, kl=kl, kl_coef=1.0),
        [[0.518557, 0.655019, 0.927944], [-1.391915, -0.709604, 0.0]],
    )


def test_reinforce_plus_plus_discount():
    mask = torch.ones(2, 2)
    # returns 0.5, 1 | 0, 0; mean 0.375; sample std sqrt(0.6875 / 3) = 0.478714
    close(
        reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), mask, gamma=0.5),
        [[0.261116, 1.305582], [-0.783349, -0.783349]],
    )


def test_reinforce_plus_plus_rewards_the_last_trained_token_and_returns_run_back_over_untrained_ones():
    # Response 0: a token of the policy, a tool's token, the policy's last; response 1 as before its padding.
    spliced = reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), torch.tensor([[1, 0, 1], [1, 1, 0]]))
    plain = reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), torch.tensor([[1, 1], [1, 1]]))
    torch.testing.assert_close(spliced[0, [0, 2]], plain[0])  # the first turn gets the reward of the whole
    assert spliced[0, 1] == 0.0  # the tool's token gets no advantage
    torch.testing.assert_close(spliced[1, :2], plain[1])


def test_reinforce_plus_plus_baseline_subtracts_group_mean():
    # groups (1, 0), (1, 1) -> 0.5, -0.5, 0, 0; mean 0, sample std sqrt(0.5 / 3) = 0.408248
    close(
        reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.ones(4, 1), group_size=2),
        [[1.224745], [-1.224745], [0.0], [0.0]],
    )


def test_groups_of_their_own_sizes_are_each_normalised_over_the_whole_group():
    # a custom generate function's fan-out: groups of 3 and 2 (rewards 1, 0, 0 | 1, 0)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0])
    # GRPO: group 1 mean 1/3, sample std sqrt((4/9 + 2 * 1/9) / 2) = 0.57735 -> 1.154701, -0.577350 (x2);
    # group 2 mean 0.5, std 0.707107 -> +-0.707107
    close(grpo_sequence_advantages(rewards, group_size=[3, 2]), [1.154701, -0.577350, -0.577350, 0.707107, -0.707107])
    close(grpo_sequence_advantages(rewards, [3, 2], normalize_std=False), [2 / 3, -1 / 3, -1 / 3, 0.5, -0.5])
    # RLOO: r=1 in 3: 1 - mean(0, 0) = 1; r=0: 0 - mean(1, 0) = -0.5; in 2: 1 - 0 = 1, 0 - 1 = -1
    close(rloo_sequence_advantages(rewards, [3, 2]), [1.0, -0.5, -0.5, 1.0, -1.0])
    # REINFORCE++-baseline: centred 2/3, -1/3, -1/3, 0.5, -0.5 (mean 0), sample std sqrt((4/9 + 2/9 + 0.5) / 4)
    centred = torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.5, -0.5])
    expected = (centred / centred.std()).view(5, 1).tolist()
    close(reinforce_plus_plus_advantages(rewards, torch.ones(5, 1), [3, 2]), expected)
    # the same sizes as an int give the same advantages
    close(grpo_sequence_advantages(REWARDS, [4, 4]), grpo_sequence_advantages(REWARDS, 4).tolist())
    with pytest.raises(ValueError, match=r"group sizes \[3, 3\] do not add up to the 5 rewards"):
        grpo_sequence_advantages(rewards, [3, 3])
    with pytest.raises(ValueError, match="rloo needs group_size >= 2"):
        rloo_sequence_advantages(rewards, [4, 1])


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="group_size=3"):
        grpo_sequence_advantages(REWARDS, group_size=3)
    with pytest.raises(ValueError, match="rloo"):
        compute_advantages("vtrace", REWARDS, torch.ones(8, 1), group_size=4)
    with pytest.raises(ValueError, match="empty"):
        reinforce_plus_plus_advantages(torch.tensor([1.0]), torch.zeros(1, 2))
