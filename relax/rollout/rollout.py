"""One rollout: prompts from the loader -> n samples each from the engine -> rewards -> groups.

    result = rollout(engine, loader, reward_fn, RolloutConfig(sampling=..., num_prompts=32))
    result.groups         # num_prompts groups of sampling.n samples (token ids, logprobs, reward)
    result.metrics        # reward / length / truncation / failure / dynamic-sampling statistics
"""

from dataclasses import dataclass, field

from relax.rollout.data import Prompt, PromptLoader
from relax.rollout.engine import SamplingConfig
from relax.rollout.groups import (
    DynamicSamplingStats,
    Group,
    Sample,
    apply_overlong_penalty,
    fill_with_informative_groups,
    group_by_prompt,
)
from relax.rollout.rewards import RewardFn, RewardInput, RewardReport, score


@dataclass(frozen=True)
class RolloutConfig:
    sampling: SamplingConfig
    num_prompts: int  # groups per rollout
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal and refill
    max_dynamic_sampling_rounds: int = 10
    overlong_buffer_tokens: int = 0  # > 0: DAPO soft overlong penalty over the last this many tokens
    reward_failure_score: float = 0.0  # the reward of a sample whose reward function raised


@dataclass
class RolloutResult:
    groups: list[Group]
    reward_report: RewardReport
    dynamic_sampling: DynamicSamplingStats | None = None
    metrics: dict = field(default_factory=dict)


def generate_groups(
    engine, prompts: list[Prompt], reward_fn: RewardFn, config: RolloutConfig
) -> tuple[list[Group], RewardReport]:
    """Sample config.sampling.n responses per prompt in one batched engine call, score and group them."""
    completions = engine.generate([prompt.token_ids for prompt in prompts], config.sampling)
    samples = [
        Sample(
            prompt=prompt,
            response_token_ids=completion.token_ids,
            response_logprobs=completion.logprobs,
            finish_reason=completion.finish_reason,
            response_text=completion.text,
        )
        for prompt, prompt_completions in zip(prompts, completions, strict=True)
        for completion in prompt_completions
    ]
    reward_inputs = [
        RewardInput(
            prompt=s.prompt.text,
            response=s.response_text,
            label=s.prompt.label,
            metadata=s.prompt.metadata,
            finish_reason=s.finish_reason,
        )
        for s in samples
    ]
    scores, failed, report = score(reward_fn, reward_inputs, config.reward_failure_score)
    for sample, value, sample_failed in zip(samples, scores, failed):
        sample.reward, sample.reward_failed = value, sample_failed
    if config.overlong_buffer_tokens > 0:
        apply_overlong_penalty(samples, config.sampling.max_new_tokens, config.overlong_buffer_tokens)
    return group_by_prompt(samples, config.sampling.n), report


def rollout(engine, loader: PromptLoader, reward_fn: RewardFn, config: RolloutConfig) -> RolloutResult:
    reward_report = RewardReport()

    def next_groups(count: int) -> list[Group]:
        prompts = loader.take(count)
        if not prompts:
            return []
        groups, report = generate_groups(engine, prompts, reward_fn, config)
        reward_report.merge(report)
        return groups

    stats = None
    if config.dynamic_sampling:
        groups, stats = fill_with_informative_groups(
            next_groups, config.num_prompts, config.max_dynamic_sampling_rounds
        )
    else:
        groups = next_groups(config.num_prompts)
        if len(groups) < config.num_prompts:
            raise RuntimeError(
                f"prompt data ran out: {len(groups)} of {config.num_prompts} prompts left (loader at {loader.position})"
            )
    result = RolloutResult(groups=groups, reward_report=reward_report, dynamic_sampling=stats)
    result.metrics = rollout_metrics(result)
    return result


def rollout_metrics(result: RolloutResult) -> dict[str, float]:
    samples = [sample for group in result.groups for sample in group.samples]
    lengths = [len(sample.response_token_ids) for sample in samples]
    metrics = {
        "rollout/reward_mean": sum(s.reward for s in samples) / len(samples),
        "rollout/response_len_mean": sum(lengths) / len(lengths),
        "rollout/response_len_max": max(lengths),
        "rollout/truncated_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout/reward_failures": result.reward_report.failures,
    }
    if result.dynamic_sampling is not None:
        metrics.update(result.dynamic_sampling.metrics())
    return metrics
