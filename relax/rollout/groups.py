"""Samples grouped per prompt, DAPO dynamic sampling and DAPO's soft overlong punishment.

GRPO-style advantages compare the samples of one prompt with each other, so a group whose rewards are
all equal teaches nothing. Dynamic sampling (DAPO, arXiv:2503.14476) drops such groups and generates
more until the batch is full; its statistics say how much was thrown away. A group with a sample the engine
refused (a failed sample: no response) lacks a member of those statistics, so it is dropped and refilled the
same way, with or without dynamic sampling (relax.rollout.rollout.collect_groups fills a step's groups).
"""

from dataclasses import dataclass, field

import torch

from relax.rollout.data import Prompt
from relax.rollout.tool_calls import ToolUse


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
    # What a multi-turn sample's turns did (--tools: relax.rollout.tool_calls.ToolUse); None for a single-turn one
    tool_use: ToolUse | None = None
    # Why the engine refused this sample's request (relax.rollout.engine.Completion.error), or None. A failed
    # sample has no response and is never scored; it fails its group.
    failure: str | None = None
    # The step whose rollout sampled each response token: an earlier step's for the tokens of a response that
    # partial rollout continued (relax.rollout.partial). None: the step's own (and saved samples replayed).
    response_steps: list[int] | None = None
    reward_preset: bool = False  # a custom generate function set the reward: the reward function is not called
    # The sample's own prompt ids where they are not its data row's (a custom generate function's sample that starts
    # from other ids: relax.rollout.custom_generate); None: prompt.token_ids. Read them as prompt_ids.
    own_prompt_ids: list[int] | None = None
    # The samples of its group (its prompt's, in a step or an evaluation), itself included: --n-samples-per-prompt,
    # or more where a custom generate function's calls fanned out (relax.rollout.custom_generate). None: not known
    # to be other than --n-samples-per-prompt (group_sizes).
    group_size: int | None = None

    @property
    def prompt_ids(self) -> list[int]:
        """The ids the response follows, which the sample trains on with it."""
        return self.prompt.token_ids if self.own_prompt_ids is None else self.own_prompt_ids

    def __post_init__(self):
        if self.own_prompt_ids is not None and not self.own_prompt_ids:
            raise ValueError("a sample's own prompt ids are empty: a response follows at least one prompt id")
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


def group_sizes(samples: list[Sample], samples_per_prompt: int) -> list[int]:
    """The size of each group of samples listed group by group (consecutive samples of one prompt): each group's
    samples carry it (Sample.group_size: a custom generate function's fan-out makes groups larger), or
    samples_per_prompt where they carry none."""
    sizes, start = [], 0
    while start < len(samples):
        sizes.append(samples[start].group_size or samples_per_prompt)
        start += sizes[-1]
    if start != len(samples):
        raise ValueError(f"{len(samples)} samples do not split into groups of {'/'.join(map(str, sorted(set(sizes))))}")
    start = 0
    for size in sizes:
        members = samples[start : start + size]
        if any(s.prompt is not members[0].prompt or (s.group_size or samples_per_prompt) != size for s in members):
            raise ValueError(f"samples {start}..{start + size - 1} do not share one prompt and one group size")
        start += size
    return sizes


def group_by_prompt(samples: list[Sample], samples_per_prompt: int) -> list[Group]:
    """Groups from samples listed group by group (group_sizes)."""
    groups, start = [], 0
    for size in group_sizes(samples, samples_per_prompt):
        groups.append(Group(prompt=samples[start].prompt, samples=samples[start : start + size]))
        start += size
    return groups


# --- filling a step's groups: failed groups, dynamic sampling, over-sampling --------------------------

class FillError(RuntimeError):
    """The step's groups could not be filled."""


class AllSamplesFailed(FillError):
    """The engine refused every request of the step so far: a bad input or setting, not bad luck."""


@dataclass
class FillStats:
    """What filling a step's groups took (relax.rollout.rollout.collect_groups)."""

    groups_submitted: int = 0
    groups_completed: int = 0  # came back complete before the batch was full
    groups_kept: int = 0
    groups_failed: int = 0  # a sample of theirs failed in the engine
    # Scored, with all rewards equal: no learning signal under a group baseline (dropped with dynamic sampling).
    groups_equal_rewards: int = 0
    groups_aborted: int = 0  # in flight when the batch was full, and cut short by the abort
    prompts_returned: int = 0  # of the groups in flight when the batch was full: put back into the prompt stream
    equal_rewards_by_reward: dict[float, int] = field(default_factory=dict)  # those groups, by their shared reward
    samples_generated: int = 0
    samples_failed: int = 0
    samples_aborted_by_function: int = 0  # a custom generate function returned them ABORTED: their prompts put back
    failures: list[str] = field(default_factory=list)  # the first distinct reasons (MAX_REPORTED_FAILURES)

    def metrics(self, dynamic_sampling: bool) -> dict[str, float]:
        """The submitted, aborted and put back groups, the failed samples and groups, the share of scored groups
        whose rewards differ; with dynamic sampling, its groups too."""
        scored = self.groups_completed - self.groups_failed
        counts = {
            "rollout/failed_samples": self.samples_failed,
            "rollout/failed_groups": self.groups_failed,
            "rollout/submitted_groups": self.groups_submitted,
            "rollout/aborted_groups": self.groups_aborted,
            "rollout/returned_prompts": self.prompts_returned,
            "rollout/informative_group_fraction": (scored - self.groups_equal_rewards) / max(scored, 1),
        }
        if self.samples_aborted_by_function:  # only a custom generate function returns samples ABORTED
            counts["rollout/function_aborted_samples"] = self.samples_aborted_by_function
        if not dynamic_sampling:
            return counts
        return {
            **counts,
            "rollout/generated_groups": self.groups_completed,
            "rollout/kept_groups": self.groups_kept,
            "rollout/dropped_groups": self.groups_equal_rewards,
        }

    def count_failures(self, group: Group) -> None:
        self.groups_failed += 1
        failed = [sample for sample in group.samples if sample.failure is not None]
        self.samples_failed += len(failed)
        self.failures = list(dict.fromkeys([*self.failures, *failure_reasons(failed)]))[:MAX_REPORTED_FAILURES]

    def count_equal_rewards(self, group: Group) -> None:
        self.groups_equal_rewards += 1
        shared = group.rewards[0] if group.samples else 0.0
        self.equal_rewards_by_reward[shared] = self.equal_rewards_by_reward.get(shared, 0) + 1

    def failures_text(self) -> str:
        return (
            f"{self.samples_failed} samples in {self.groups_failed} groups failed in the engine (first reasons: "
            f"{' | '.join(self.failures)})"
        )


REFUSAL_FIX = (
    "the engine refuses a request whose prompt plus --rollout-max-response-len tokens exceed its context length "
    "(filter long prompts with --max-prompt-length, lower --rollout-max-response-len, or raise "
    "--sglang-context-length where the model allows it) and sampling settings it does not accept"
)


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
