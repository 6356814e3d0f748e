"""Advantage estimators for outcome rewards (one scalar reward per response), as plain functions.

Rewards come as a flat [N] tensor in rollout order: the responses to one prompt are contiguous, group_size of
them (N = num_prompts * group_size), or each group's own size where they differ (a custom generate function's
fan-out). Each estimator returns per-token advantages [N, T] for the response
mask [N, T], ready for relax.train.losses.policy_loss.

- group-relative (GRPO's, used by gspo and cispo too, whose differences are in the loss): reward minus its
  group's mean, divided by the group's std unless normalize_std=False (Dr. GRPO drops the std).
- leave-one-out (RLOO): r_i minus the mean of the other responses to the same prompt.
- REINFORCE++: the return of every token (the outcome reward at the last response token, minus
  kl_coef * per-token KL to the reference when given, summed to the end with discount gamma), then normalised
  over all response tokens of the batch (mean 0, std 1). A group of more than one response has its mean
  reward subtracted first (REINFORCE++-baseline).

relax.train.algorithms names which of these each --advantage-estimator uses.
"""

import torch


GroupSize = int | list[int]  # every group's size, or each group's in rollout order (a custom generate function's
# fan-out makes a prompt's group larger than --n-samples-per-prompt: relax.rollout.groups.group_sizes)


def _groups(rewards: torch.Tensor, group_size: GroupSize) -> list[torch.Tensor]:
    """The rewards of each group, in rollout order."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a flat [N] tensor, got shape {tuple(rewards.shape)}")
    if isinstance(group_size, int):
        if group_size < 1 or rewards.numel() % group_size != 0:
            raise ValueError(
                f"{rewards.numel()} rewards do not split into groups of group_size={group_size}: the n responses "
                "of each prompt must be contiguous and complete"
            )
        group_size = [group_size] * (rewards.numel() // group_size)
    if min(group_size, default=1) < 1 or sum(group_size) != rewards.numel():
        raise ValueError(f"group sizes {group_size} do not add up to the {rewards.numel()} rewards, each at least 1")
    return list(rewards.split(group_size))


def _centred(values: torch.Tensor) -> torch.Tensor:
    """values minus their mean over the last dimension, measured from the first value: equal values give exact
    zeros, where the float32 mean of eight 0.7s is not 0.7 and that rounding, divided by a std as small, gave
    +0.056 (a batch of equal REINFORCE++ returns: -0.84 on every token)."""
    offsets = values - values[..., :1]
    return offsets - offsets.mean(-1, keepdim=True)


def to_tokens(sequence_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every response token its sequence's value: [N] -> [N, T], zero on padding."""
    if sequence_values.shape[0] != mask.shape[0]:
        raise ValueError(f"{sequence_values.shape[0]} sequence values for {mask.shape[0]} masked rows")
    return sequence_values.unsqueeze(-1) * mask.to(sequence_values.dtype)


def grpo_sequence_advantages(
    rewards: torch.Tensor, group_size: GroupSize, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantage per response, [N]. The std is the unbiased sample std of the group (as
    torch.std); a group with equal rewards gets zero advantages."""
    advantages = []
    for group in _groups(rewards, group_size):
        centred = _centred(group)
        if normalize_std:
            if group.numel() < 2:
                raise ValueError("normalize_std needs group_size >= 2 (the std of one response is undefined)")
            centred = centred / (group.std() + eps)
        advantages.append(centred)
    return torch.cat(advantages)


def rloo_sequence_advantages(rewards: torch.Tensor, group_size: GroupSize) -> torch.Tensor:
    """Leave-one-out: r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - group mean), [N] (G: the group's size)."""
    advantages = []
    for group in _groups(rewards, group_size):
        if group.numel() < 2:
            raise ValueError("rloo needs group_size >= 2 (a leave-one-out baseline needs another response)")
        advantages.append(group.numel() / (group.numel() - 1) * _centred(group))
    return torch.cat(advantages)


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_size: GroupSize = 1,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ token advantages [N, T] (see module doc)."""
    if kl_coef != 0.0 and kl is None:
        raise ValueError("reinforce_plus_plus: kl_coef is set but no per-token kl was given")
    sequence_rewards = torch.cat([_centred(group) if group.numel() > 1 else group
                                  for group in _groups(rewards, group_size)])
    mask = mask.to(rewards.dtype)
    trained = mask.sum(-1) > 0
    if not trained.all():
        raise ValueError(
            f"reinforce_plus_plus: responses {torch.nonzero(~trained).flatten().tolist()} are empty (no trained token)"
        )
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # each response's last trained token: it gets the reward
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(mask.shape[0]), last] = sequence_rewards
    if kl is not None:
        token_rewards = token_rewards - kl_coef * kl * mask
    # Returns run back over untrained tokens too (a tool's output between two turns passes the reward on to the
    # turn before it); past the last trained token every reward is 0, so the returns there are 0.
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(sequence_rewards)
    for t in reversed(range(mask.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
    valid = mask.bool()
    whitened = torch.zeros_like(returns)
    whitened[valid] = _centred(returns[valid]) / (returns[valid].std() + eps)
    return whitened

