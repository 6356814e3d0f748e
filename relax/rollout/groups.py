"""Samples grouped per prompt, DAPO dynamic sampling and DAPO's soft overlong punishment.

GRPO-style advantages compare the samples of one prompt with each other, so a group whose rewards are
all equal teaches nothing. Dynamic sampling (DAPO, arXiv:2503.14476) drops such groups and generates
more until the batch is full; its statistics say how much was thrown away. A group with a sample the engine
refused (a failed sample: no response) lacks a member of those statistics, so it is dropped and refilled the
same way, with or without dynamic sampling.
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
    # Why the engine refused this sample's request (relax.rollout.engine.Completion.error), or None. A failed
    # sample has no response and is never scored; it fails its group.
    failure: str | None = None

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

    @property
    def failed(self) -> bool:
        return any(sample.failure is not None for sample in self.samples)


MAX_REPORTED_FAILURES = 3  # distinct failure reasons a report names


def failure_reasons(samples: list[Sample], limit: int = MAX_REPORTED_FAILURES) -> list[str]:
    """The first `limit` distinct reasons among the failed samples, in sample order."""
    return list(dict.fromkeys(s.failure for s in samples if s.failure is not None))[:limit]


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


# --- filling a step's groups: failed groups, and dynamic sampling --------------------------------------

class FillError(RuntimeError):
    """The step's groups could not be filled."""


class AllSamplesFailed(FillError):
    """The engine refused every request of the step so far: a bad input or setting, not bad luck."""


@dataclass
class FillStats:
    rounds: int = 0  # generation rounds
    groups_generated: int = 0
    groups_kept: int = 0
    groups_failed: int = 0  # a sample of theirs failed in the engine
    groups_dropped: int = 0  # all rewards equal (dynamic sampling)
    groups_surplus: int = 0  # kept, but generated after the batch was full (a round may bring more)
    dropped_by_reward: dict[float, int] = field(default_factory=dict)  # the shared reward of dropped groups
    samples_generated: int = 0
    samples_failed: int = 0
    failures: list[str] = field(default_factory=list)  # the first distinct reasons (MAX_REPORTED_FAILURES)

    def metrics(self, dynamic_sampling: bool) -> dict[str, float]:
        """The failed samples and groups; with dynamic sampling, its rounds and groups too."""
        failures = {"rollout/failed_samples": self.samples_failed, "rollout/failed_groups": self.groups_failed}
        if not dynamic_sampling:
            return failures
        scored = self.groups_generated - self.groups_failed
        return {
            **failures,
            "rollout/generation_rounds": self.rounds,
            "rollout/generated_groups": self.groups_generated,
            "rollout/kept_groups": self.groups_kept,
            "rollout/dropped_groups": self.groups_dropped,
            "rollout/surplus_groups": self.groups_surplus,
            "rollout/informative_group_fraction": (scored - self.groups_dropped) / max(scored, 1),
        }

    def count_failures(self, group: Group) -> None:
        self.groups_failed += 1
        failed = [sample for sample in group.samples if sample.failure is not None]
        self.samples_failed += len(failed)
        self.failures = list(dict.fromkeys([*self.failures, *failure_reasons(failed)]))[:MAX_REPORTED_FAILURES]

    def failures_text(self) -> str:
        return (
            f"{self.samples_failed} samples in {self.groups_failed} groups failed in the engine (first reasons: "
            f"{' | '.join(self.failures)})"
        )


DEFAULT_MAX_ROUNDS = 10  # --dynamic-sampling-max-rounds when not given; the rounds refilling failed groups without it

REFUSAL_FIX = (
    "the engine refuses a request whose prompt plus --rollout-max-response-len tokens exceed its context length "
    "(filter long prompts with --max-prompt-length, lower --rollout-max-response-len, or raise "
    "--sglang-context-length where the model allows it) and sampling settings it does not accept"
)


def fill_groups(
    generate_groups: Callable[[int], list[Group]], num_groups: int, max_rounds: int = DEFAULT_MAX_ROUNDS,
    informative_only: bool = True,
) -> tuple[list[Group], FillStats]:
    """Call generate_groups(k) for k more groups (it may return more) until num_groups are kept: groups none of
    whose samples failed in the engine and, with `informative_only` (dynamic sampling), whose rewards differ. Kept
    groups beyond num_groups are counted as surplus and not used. Fails with the counts after max_rounds rounds,
    when generate_groups has no more data, and at once when every sample so far failed (AllSamplesFailed): a
    batch is never silently short."""
    stats = FillStats()
    kept: list[Group] = []
    while len(kept) < num_groups:
        if stats.rounds == max_rounds:
            raise FillError(_rounds_used_up(stats, len(kept), num_groups, max_rounds, informative_only))
        stats.rounds += 1
        groups = generate_groups(num_groups - len(kept))
        if not groups:
            raise FillError(
                f"prompt data ran out while filling the step's groups with {len(kept)} of {num_groups} kept"
            )
        stats.groups_generated += len(groups)
        for group in groups:
            stats.samples_generated += len(group.samples)
            if group.failed:
                stats.count_failures(group)
            elif informative_only and group.rewards_all_equal():
                stats.groups_dropped += 1
                shared = group.rewards[0] if group.samples else 0.0
                stats.dropped_by_reward[shared] = stats.dropped_by_reward.get(shared, 0) + 1
            elif len(kept) < num_groups:
                kept.append(group)
            else:
                stats.groups_surplus += 1
        if stats.samples_failed == stats.samples_generated:
            raise AllSamplesFailed(
                f"the engine refused every one of the {stats.samples_generated} samples of this step; first: "
                f"{stats.failures[0]}; {REFUSAL_FIX}"
            )
    stats.groups_kept = len(kept)
    return kept, stats


def _rounds_used_up(stats: FillStats, kept: int, num_groups: int, max_rounds: int, informative_only: bool) -> str:
    why = [f"{stats.failures_text()}; their groups were dropped"] if stats.groups_failed else []
    if informative_only:
        why.append(
            f"{stats.groups_dropped} of {stats.groups_generated} groups had equal rewards (by shared reward: "
            f"{stats.dropped_by_reward}). The task is too easy or too hard for the model, or the reward is broken; "
            "raise the round limit (--dynamic-sampling-max-rounds) or turn dynamic sampling off"
        )
    else:
        why.append(REFUSAL_FIX)
    return f"kept {kept} of {num_groups} groups after {max_rounds} rounds: " + "; ".join(why)


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
