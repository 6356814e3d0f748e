"""A step's rollout behind one interface, so that other rollouts (over-sampling, asynchronous, multi-turn with tool
calls) can sit beside today's.

The loop calls a Rollout once per step with a RolloutRequest and trains on what it returns (RolloutResult):
    in   the step: the policy version, i.e. the engines hold the weights trained through that many steps; the
         prompts (a PromptLoader: a rollout takes as many as it needs, dynamic sampling more than it keeps, and
         puts back those it took but did not use); how
         many prompt groups the step trains on; the sampling settings, seeded for the step
    out  num_groups x sampling.n scored Samples (more where a custom generate function fanned out), prompt by
         prompt (relax.rollout.groups.Sample: the response's tokens, its loss mask, the engine's logprobs, the
         reward), and the rollout's metrics
What the loop does around every rollout stays there: saving the samples (--save-rollout-data), the reward and
length metrics, the overlong penalty.

    GenerateAndScore  the default: sampling.n responses per prompt from the engines, group by group as they
                      complete, scored by the reward function; with --over-sampling-batch-size, more prompts in
                      flight than the step needs, the rest aborted and put back; with --dynamic-sampling, new
                      prompts until enough groups teach something; a group with a sample the engine refused is
                      replaced by a group of a new prompt; with --partial-rollout, the aborted groups are put back
                      with what they generated, and continued
    Replay            --load-rollout-data: the samples a run saved for the step

A user's function that generates each sample itself (slime's --custom-generate-function-path) runs inside
GenerateAndScore's engine actors; its API (the Sample it gets and returns, `generate` to the engine beside it, the
helpers that append a turn keeping the loss mask and logprobs aligned) is relax.rollout.custom_generate.
"""

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from relax.rollout.data import PromptLoader
from relax.rollout.dump import load_rollout_data
from relax.rollout.engine import SamplingConfig
from relax.rollout.groups import Sample
from relax.rollout.rewards import RewardFn
from relax.rollout.rollout import EnginePool, Partial, collect_groups


class RolloutRequest(NamedTuple):
    step: int  # the policy version: the engines hold the weights trained through this many steps
    prompts: PromptLoader | None  # None where the rollout reads none (Replay)
    num_groups: int  # prompt groups the step trains on
    sampling: SamplingConfig  # n samples per prompt; seed: the step's first (relax.run.state.sampling_seed)


class RolloutResult(NamedTuple):
    samples: list[Sample]  # num_groups x sampling.n (or more: fan-out, Sample.group_size), prompt by prompt, scored
    metrics: dict[str, float]  # the rollout's own (its groups' counts); the loop adds the reward metrics


class Rollout(Protocol):
    def __call__(self, request: RolloutRequest) -> RolloutResult: ...


@dataclass(frozen=True)
class Filling:
    """How a step's groups are filled (relax.rollout.rollout.collect_groups)."""

    over_sampling_batch_size: int  # prompts submitted at a time while fewer are in flight than still needed
    dynamic_sampling: bool  # DAPO: groups with equal rewards are dropped
    max_prompts: int  # --rollout-max-prompts: the most a step submits before it fails with the counts
    partial: Partial | None = None  # --partial-rollout: aborted groups are put back with their tokens


@dataclass(frozen=True)
class GenerateAndScore:
    """The default rollout: the engines (`pool`) answer each prompt sampling.n times, group by group as they
    complete, and `reward_fn` scores every response, until request.num_groups groups are kept (`filling`); the
    groups still in flight are then aborted and their prompts put back. A group with a sample the engine refused
    is dropped and replaced at once: the step trains on a full batch, as the training batch's shape needs (whole
    optimizer steps of --global-batch-size samples)."""

    pool: EnginePool
    reward_fn: RewardFn
    filling: Filling

    def __call__(self, request: RolloutRequest) -> RolloutResult:
        return RolloutResult(*collect_groups(
            self.pool, request.prompts, request.sampling, self.reward_fn, num_groups=request.num_groups,
            chunk_size=self.filling.over_sampling_batch_size, dynamic_sampling=self.filling.dynamic_sampling,
            max_prompts=self.filling.max_prompts, step=request.step, partial=self.filling.partial,
        ))


@dataclass(frozen=True)
class Replay:
    """The samples saved for the request's step under `pattern` (relax.rollout.dump), checked against its batch
    shape; with their routed experts if `with_routed_experts`."""

    pattern: str
    with_routed_experts: bool

    def __call__(self, request: RolloutRequest) -> RolloutResult:
        samples = load_rollout_data(
            self.pattern, request.step, request.num_groups, request.sampling.n, self.with_routed_experts
        )
        return RolloutResult(samples, {})
