"""The rollout phase, wherever the engines run: prompts -> sampling.n responses each -> rewards -> samples,
with DAPO dynamic sampling and the rollout metrics.

`generate(token_id_prompts, sampling)` is any callable returning sampling.n Completions per prompt, in prompt
order, each request sampled with its own seed counted from sampling.seed: an in-process RolloutEngine.generate
(request i: seed + i), or the loop's spread of the prompts over the Ray engine actors
(relax.loop.generate_on_engines).

    samples = generate_and_score(engine.generate, loader.take(32), sampling, reward_fn)
    metrics = reward_and_length_metrics(samples)
"""

import itertools
import sys
from dataclasses import replace
from typing import Callable

import torch

from relax.rollout.data import Prompt, PromptLoader
from relax.rollout.engine import Completion, SamplingConfig
from relax.rollout.groups import Sample, fill_with_informative_groups, group_by_prompt
from relax.rollout.rewards import RewardFn, RewardInput, score

Generate = Callable[[list[list[int]], SamplingConfig], list[list[Completion]]]

ROUND_SEED_STRIDE = 2**16  # sampling seeds per dynamic-sampling round (a step has 2**24: run_state.sampling_seed)


def generate_and_score(
    generate: Generate, prompts: list[Prompt], sampling: SamplingConfig, reward_fn: RewardFn
) -> list[Sample]:
    """sampling.n scored samples per prompt, prompt by prompt (n consecutive samples each) in prompt order."""
    completions = generate([prompt.token_ids for prompt in prompts], sampling)
    samples = [
        Sample(prompt, c.token_ids, c.logprobs, c.finish_reason, c.text)
        for prompt, prompt_completions in zip(prompts, completions, strict=True)
        for c in prompt_completions
    ]
    scores, failed, report = score(
        reward_fn,
        [RewardInput(s.prompt.text, s.response_text, s.prompt.label, s.prompt.metadata, s.finish_reason) for s in samples],
    )
    for sample, value, was_failure in zip(samples, scores, failed):
        sample.reward, sample.reward_failed = value, was_failure
    if report.failures:  # scored 0 and counted in the metrics; the reasons must reach the user too
        print(
            f"relax: reward function {reward_fn.name!r} raised on {report.failures} of {len(samples)} samples "
            f"(each scored 0.0); first: {'; '.join(report.errors[:3])}",
            file=sys.stderr, flush=True,
        )
    return samples


def take_prompts(loader: PromptLoader, count: int) -> list[Prompt]:
    """The loader's next `count` prompts; a loader that runs out is an error, never a short batch."""
    prompts = loader.take(count)
    if len(prompts) < count:
        raise RuntimeError(f"prompt data ran out: {len(prompts)} of {count} prompts left (loader at {loader.position})")
    return prompts


def generate_informative_groups(
    generate: Generate, loader: PromptLoader, sampling: SamplingConfig, reward_fn: RewardFn,
    num_groups: int, prompts_per_round: int, max_rounds: int,
) -> tuple[list[Sample], dict[str, float]]:
    """DAPO dynamic sampling: rounds of `prompts_per_round` new prompts, each round with its own sampling seeds,
    until `num_groups` groups whose rewards differ are kept (relax.rollout.groups.fill_with_informative_groups:
    it fails with the counts after `max_rounds` rounds). Returns their samples and the round statistics."""
    rounds = itertools.count()

    def one_round(_groups_still_needed: int):  # a whole round each time: most groups may be dropped again
        round_sampling = offset_seed(sampling, next(rounds) * ROUND_SEED_STRIDE)
        samples = generate_and_score(generate, loader.take(prompts_per_round), round_sampling, reward_fn)
        return group_by_prompt(samples, sampling.n)

    groups, stats = fill_with_informative_groups(one_round, num_groups, max_rounds)
    return [sample for group in groups for sample in group.samples], stats.metrics()


def offset_seed(sampling: SamplingConfig, offset: int) -> SamplingConfig:
    """`sampling` numbering its requests' seeds from sampling.seed + offset (no seed: unchanged)."""
    return sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + offset)


def reward_and_length_metrics(samples: list[Sample]) -> dict[str, float]:
    """The rollout/ metrics of samples (of the reward function's rewards: before any overlong penalty)."""
    rewards = torch.tensor([s.reward for s in samples])
    lengths = torch.tensor([len(s.response_token_ids) for s in samples], dtype=torch.float32)
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if len(samples) > 1 else 0.0,
        "rollout/reward_failures": float(sum(s.reward_failed for s in samples)),
        "rollout/response_length_mean": lengths.mean().item(),
        "rollout/response_length_max": lengths.max().item(),
        "rollout/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
