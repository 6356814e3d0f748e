"""Samples grouped per prompt, DAPO dynamic sampling and DAPO's soft overlong punishment.

GRPO-style advantages compare the samples of one prompt with each other, so a group whose rewards are
all equal teaches nothing. Dynamic sampling (DAPO, arXiv:2503.14476) drops such groups and generates
more until the batch is full; its statistics say how much was thrown away.
"""

from dataclasses import dataclass, field
from typing import Callable

import torch

from relax.rollout.data import Prompt


@dataclass
class Sample:
    prompt: Prompt
    response_token_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token), "length" (max new tokens) or "abort"
    response_text: str = ""
    reward: float = 0.0
    reward_failed: bool = False  # the reward function raised or timed out for this sample; reward is the failure score
    reward_timed_out: bool = False  # its reward call ran past --reward-timeout (reward_failed too)
    # The experts the engine's routers chose (--use-rollout-routing-replay), relax.rollout.engine.Completion's
    routed_experts: torch.Tensor | None = None
    # Per response token: 1 where the loss trains it, 0 where it does not (a token the policy did not sample, such as
    # a tool's output spliced into the response). None: every response token is trained.
    loss_mask: list[int] | None = None

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_token_ids)
        if len(self.loss_mask) != len(self.response_token_ids) or not set(self.loss_mask) <= {0, 1}:
            raise ValueError(
                f"a loss_mask of {len(self.loss_mask)} values: it must hold a 0 or 1 for each of the "
                f"{len(self.response_token_ids)} response tokens"
            )


@dataclass
class Group:
    prompt: Prompt
    samples: list[Sample]

    @property
    def rewards(self) -> list[float]:
        return [sample.reward for sample in self.samples]

    def rewards_all_equal(self) -> bool:
        return len(set(self.rewards)) <= 1


def group_by_prompt(samples: list[Sample], samples_per_prompt: int) -> list[Group]:
    """Groups from samples listed prompt by prompt (samples_per_prompt consecutive samples each)."""
    if len(samples) % samples_per_prompt:
        raise ValueError(f"{len(samples)} samples do not split into groups of {samples_per_prompt}")
    groups = []
    for start in range(0, len(samples), samples_per_prompt):
        members = samples[start : start + samples_per_prompt]
        if any(sample.prompt is not members[0].prompt for sample in members):
            raise ValueError(f"samples {start}..{start + samples_per_prompt - 1} do not share one prompt")
        groups.append(Group(prompt=members[0].prompt, samples=members))
    return groups


# --- dynamic sampling --------------------------------------------------------------------------------

class DynamicSamplingError(RuntimeError):
    pass


@dataclass
class DynamicSamplingStats:
    rounds: int = 0  # generation rounds
    groups_generated: int = 0
    groups_kept: int = 0
    groups_dropped: int = 0  # all rewards equal
    groups_surplus: int = 0  # informative, but generated after the batch was full (a round may bring more)
    dropped_by_reward: dict[float, int] = field(default_factory=dict)  # the shared reward of dropped groups

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/generation_rounds": self.rounds,
            "rollout/generated_groups": self.groups_generated,
            "rollout/kept_groups": self.groups_kept,
            "rollout/dropped_groups": self.groups_dropped,
            "rollout/surplus_groups": self.groups_surplus,
            "rollout/informative_group_fraction": (self.groups_generated - self.groups_dropped)
            / max(self.groups_generated, 1),
        }


DEFAULT_MAX_ROUNDS = 10  # --dynamic-sampling-max-rounds when not given


def fill_with_informative_groups(
    generate_groups: Callable[[int], list[Group]], num_groups: int, max_rounds: int = DEFAULT_MAX_ROUNDS
) -> tuple[list[Group], DynamicSamplingStats]:
    """Call generate_groups(k) for k more groups (it may return more), keeping only groups whose rewards
    differ, until num_groups are kept. Informative groups beyond num_groups are counted as surplus and not
    used. Fails with the counts after max_rounds rounds, or when generate_groups has no more data: a batch
    is never silently short."""
    stats = DynamicSamplingStats()
    kept: list[Group] = []
    while len(kept) < num_groups:
        if stats.rounds == max_rounds:
            raise DynamicSamplingError(
                f"dynamic sampling kept {len(kept)} of {num_groups} groups after {max_rounds} rounds: "
                f"{stats.groups_dropped} of {stats.groups_generated} groups had equal rewards "
                f"(by shared reward: {stats.dropped_by_reward}). The task is too easy or too hard for the "
                "model, or the reward is broken; raise the round limit (--dynamic-sampling-max-rounds) or turn "
                "dynamic sampling off."
            )
        stats.rounds += 1
        groups = generate_groups(num_groups - len(kept))
        if not groups:
            raise DynamicSamplingError(
                f"prompt data ran out during dynamic sampling with {len(kept)} of {num_groups} groups kept"
            )
        stats.groups_generated += len(groups)
        for group in groups:
            if group.rewards_all_equal():
                stats.groups_dropped += 1
                shared = group.rewards[0] if group.samples else 0.0
                stats.dropped_by_reward[shared] = stats.dropped_by_reward.get(shared, 0) + 1
            elif len(kept) < num_groups:
                kept.append(group)
            else:
                stats.groups_surplus += 1
    stats.groups_kept = len(kept)
    return kept, stats


# --- overlong punishment -----------------------------------------------------------------------------

def overlong_penalty(
    response_length: int, max_response_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer tokens, then falling linearly to -penalty_factor at
    max tokens, and -penalty_factor beyond."""
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"overlong buffer length {buffer_length} must be in (0, max response length {max_response_length}]"
        )
    free_length = max_response_length - buffer_length
    excess = min(max(response_length - free_length, 0), buffer_length)
    return -penalty_factor * excess / buffer_length


def apply_overlong_penalty(
    samples: list[Sample], max_response_length: int, buffer_length: int, penalty_factor: float
) -> None:
    """Add the soft overlong penalty to each sample's reward (in place)."""
    for sample in samples:
        sample.reward += overlong_penalty(
            len(sample.response_token_ids), max_response_length, buffer_length, penalty_factor
        )
