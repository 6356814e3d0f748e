"""The rollout phase, wherever the engines run: prompts -> sampling.n responses each -> rewards -> samples,
with DAPO dynamic sampling and the rollout metrics.

`generate(token_id_prompts, sampling)` is any callable returning sampling.n Completions per prompt, in prompt
order, request i of the call sampled with seed sampling.seed + i: an in-process RolloutEngine.generate, or the
loop's spread of the prompts over the Ray engine actors (relax.run.colocation.Colocation.generate, through
split_over_engines and completions_in_prompt_order below: each request keeps the seed it would get from one
engine, however many engines there are).

    samples = generate_and_score(engine.generate, loader.take(32), sampling, reward_fn)
    metrics = reward_and_length_metrics(samples)
"""

import itertools
from dataclasses import replace
from typing import Callable, NamedTuple

import torch

from relax.console import say
from relax.rollout.data import Prompt, PromptLoader
from relax.rollout.engine import Completion, SamplingConfig
from relax.rollout.groups import Sample, fill_groups, group_by_prompt
from relax.rollout.rewards import RewardFn, RewardInput, score

Generate = Callable[[list[list[int]], SamplingConfig], list[list[Completion]]]

STEP_SEED_SPAN = 2**24  # sampling seeds per step (run_state.sampling_seed)
ROUND_SEED_STRIDE = 2**16  # sampling seeds per round of a step (generate_groups): its requests must fit


def generate_and_score(
    generate: Generate, prompts: list[Prompt], sampling: SamplingConfig, reward_fn: RewardFn
) -> list[Sample]:
    """sampling.n samples per prompt, prompt by prompt (n consecutive samples each) in prompt order; each scored, but
    the failed ones (the engine refused their request: Sample.failure, no response), which the caller handles."""
    completions = generate([prompt.token_ids for prompt in prompts], sampling)
    samples = [
        Sample(
            prompt, c.token_ids, c.logprobs, c.finish_reason, c.text, routed_experts=c.routed_experts,
            loss_mask=[1] * len(c.token_ids),  # every token of the response is the policy's own
            failure=c.error,
        )
        for prompt, prompt_completions in zip(prompts, completions, strict=True)
        for c in prompt_completions
    ]
    responses = [s for s in samples if s.failure is None]
    scores, failed, report = score(reward_fn, [
        RewardInput(s.prompt.text, s.response_text, s.prompt.label, s.prompt.metadata, s.finish_reason)
        for s in responses
    ])
    for sample, value, was_failure in zip(responses, scores, failed):
        sample.reward, sample.reward_failed = value, was_failure
    for index in report.timed_out:
        responses[index].reward_timed_out = True
    if report.failures:  # scored 0 and counted in the metrics; the reasons must reach the user too
        say(
            f"relax: reward function {reward_fn.name!r} failed on {report.failures} of {len(responses)} samples "
            f"({len(report.timed_out)} by timing out; each scored 0.0); first: {'; '.join(report.errors[:3])}",
            error=True,
        )
    return samples


def take_prompts(loader: PromptLoader, count: int) -> list[Prompt]:
    """The loader's next `count` prompts; a loader that runs out is an error, never a short batch."""
    prompts = loader.take(count)
    if len(prompts) < count:
        raise RuntimeError(f"prompt data ran out: {len(prompts)} of {count} prompts left (loader at {loader.position})")
    return prompts


def dynamic_sampling_seeds_problem(prompts_per_round: int, n: int, max_rounds: int) -> str | None:
    """Why dynamic sampling's rounds would not fit the step's sampling seeds (each round's requests take
    seeds of their own, ROUND_SEED_STRIDE apart, within the step's STEP_SEED_SPAN), or None."""
    if prompts_per_round * n > ROUND_SEED_STRIDE:
        return (
            f"dynamic sampling: a round of {prompts_per_round} prompts x {n} samples is more than the "
            f"{ROUND_SEED_STRIDE} requests a round has sampling seeds for; lower --over-sampling-batch-size (or "
            "--rollout-batch-size, when it is not given) or --n-samples-per-prompt"
        )
    if max_rounds * ROUND_SEED_STRIDE > STEP_SEED_SPAN:
        return (
            f"dynamic sampling: --dynamic-sampling-max-rounds {max_rounds} is more rounds than a step has sampling "
            f"seeds for; give at most {STEP_SEED_SPAN // ROUND_SEED_STRIDE}"
        )
    return None


def generate_groups(
    generate: Generate, loader: PromptLoader, sampling: SamplingConfig, reward_fn: RewardFn,
    num_groups: int, prompts_per_round: int | None, max_rounds: int,
) -> tuple[list[Sample], dict[str, float]]:
    """`num_groups` scored groups of new prompts, in rounds (relax.rollout.groups.fill_groups: it fails with the
    counts after `max_rounds` rounds, or at once when every sample failed): a group with a failed sample is
    dropped and replaced by the next round. With `prompts_per_round`, DAPO dynamic sampling: every round takes that
    many prompts and keeps only groups whose rewards differ; without, the first round takes num_groups prompts
    and each later one the groups still missing. Returns their samples and the rollout metrics; the engine's
    failure reasons are printed once. Each round's requests take seeds of their own, a round's stride apart (the
    first round's are those of one generate call of the step's sampling)."""
    if prompts_per_round is not None:
        problem = dynamic_sampling_seeds_problem(prompts_per_round, sampling.n, max_rounds)
        if problem:
            raise ValueError(problem)
    round_seed_stride = max(ROUND_SEED_STRIDE, (prompts_per_round or num_groups) * sampling.n)
    rounds = itertools.count()

    def one_round(groups_still_needed: int):  # dynamic sampling: a whole round each time, most may be dropped
        round_sampling = offset_seed(sampling, next(rounds) * round_seed_stride)
        prompts = (
            take_prompts(loader, groups_still_needed) if prompts_per_round is None else loader.take(prompts_per_round)
        )
        return group_by_prompt(generate_and_score(generate, prompts, round_sampling, reward_fn), sampling.n)

    groups, stats = fill_groups(one_round, num_groups, max_rounds, informative_only=prompts_per_round is not None)
    if stats.groups_failed:
        say(f"relax: {stats.failures_text()}; their groups were dropped and generated anew from other prompts",
            error=True)
    return [sample for group in groups for sample in group.samples], stats.metrics(prompts_per_round is not None)


def offset_seed(sampling: SamplingConfig, offset: int) -> SamplingConfig:
    """`sampling` numbering its requests' seeds from sampling.seed + offset (no seed: unchanged)."""
    return sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + offset)


class EngineShare(NamedTuple):
    """The part of one generate call that one engine serves."""

    engine: int  # the engine's index
    prompts: list[list[int]]
    sampling: SamplingConfig  # seeds from the call's seed + (the call's index of its first prompt) x n


def split_over_engines(prompts: list[list[int]], sampling: SamplingConfig, num_engines: int) -> list[EngineShare]:
    """One generate call spread over `num_engines` engines: consecutive shares of the prompts whose sizes differ by
    at most one, one per engine that gets any (fewer prompts than engines: the last engines get none and are not
    called). The share starting at prompt p numbers its seeds from sampling.seed + p x n, so request i of the
    call samples with seed + i as it would on one engine: no two requests share a seed, and the call takes no
    more seeds than on one engine."""
    if num_engines < 1:
        raise ValueError(f"split_over_engines: num_engines must be at least 1, got {num_engines}")
    size, larger = divmod(len(prompts), num_engines)  # the first `larger` engines take one prompt more
    shares, start = [], 0
    for engine in range(min(num_engines, len(prompts))):
        end = start + size + (engine < larger)
        shares.append(EngineShare(engine, prompts[start:end], offset_seed(sampling, start * sampling.n)))
        start = end
    return shares


def most_requests_per_engine(num_prompts: int, n: int, num_engines: int) -> int:
    """The most requests one engine gets from a generate call of `num_prompts` prompts x `n` samples over
    `num_engines` engines (split_over_engines: the larger shares hold ceil(num_prompts / num_engines) prompts)."""
    return -(-num_prompts // num_engines) * n


def completions_in_prompt_order(
    shares: list[EngineShare], answers: list[list[list[Completion]]]
) -> list[list[Completion]]:
    """The engines' answers (answers[k]: share k's completions, from its engine) as one generate call's result,
    in prompt order. An engine that answered a different number of prompts, or of samples per prompt, is an
    error naming it: a completion must never be lost or land on another prompt."""
    if len(answers) != len(shares):
        raise RuntimeError(f"{len(shares)} engines were asked to generate, but {len(answers)} answered")
    completions = []
    for share, answer in zip(shares, answers):
        counts = [len(group) for group in answer]
        if len(answer) != len(share.prompts) or any(count != share.sampling.n for count in counts):
            raise RuntimeError(
                f"engine {share.engine} answered {len(answer)} prompts with {counts} completions for "
                f"{len(share.prompts)} prompts x {share.sampling.n} samples"
            )
        completions += answer
    return completions


def reward_and_length_metrics(samples: list[Sample]) -> dict[str, float]:
    """The rollout/ metrics of samples (of the reward function's rewards: before any overlong penalty)."""
    rewards = torch.tensor([s.reward for s in samples])
    lengths = torch.tensor([len(s.response_token_ids) for s in samples], dtype=torch.float32)
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if len(samples) > 1 else 0.0,
        "rollout/reward_failures": float(sum(s.reward_failed for s in samples)),
        "rollout/reward_timeouts": float(sum(s.reward_timed_out for s in samples)),
        "rollout/response_length_mean": lengths.mean().item(),
        "rollout/response_length_max": lengths.max().item(),
        "rollout/response_tokens": lengths.sum().item(),
        "rollout/prompt_tokens": float(sum(len(s.prompt.token_ids) for s in samples)),  # each sample's prompt
        "rollout/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
