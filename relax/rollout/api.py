"""A step's rollout behind one interface, so that other rollouts (over-sampling, asynchronous, multi-turn with tool
calls) can sit beside today's.

The loop calls a Rollout once per step with a RolloutRequest and trains on what it returns (RolloutResult):
    in   the step: the policy version, i.e. the engines hold the weights trained through that many steps; the
         prompts (a PromptLoader: a rollout takes as many as it needs, dynamic sampling more than it keeps); how
         many prompt groups the step trains on; the sampling settings, seeded for the step
    out  num_groups x sampling.n scored Samples, prompt by prompt (relax.rollout.groups.Sample: the response's
         tokens, its loss mask, the engine's logprobs, the reward), and the rollout's metrics
What the loop does around every rollout stays there: saving the samples (--save-rollout-data), the reward and
length metrics, the overlong penalty.

    GenerateAndScore  the default: sampling.n responses per prompt from the engines, scored by the reward function;
                      with --dynamic-sampling, rounds of new prompts until enough groups teach something; a group
                      with a sample the engine refused is replaced by a group of a new prompt
    Replay            --load-rollout-data: the samples a run saved for the step
"""

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from relax.rollout.data import PromptLoader
from relax.rollout.dump import load_rollout_data
from relax.rollout.engine import SamplingConfig
from relax.rollout.groups import DEFAULT_MAX_ROUNDS, Sample
from relax.rollout.rewards import RewardFn
from relax.rollout.rollout import Generate, generate_groups


class RolloutRequest(NamedTuple):
    step: int  # the policy version: the engines hold the weights trained through this many steps
    prompts: PromptLoader | None  # None where the rollout reads none (Replay)
    num_groups: int  # prompt groups the step trains on
    sampling: SamplingConfig  # n samples per prompt; seed: the step's first (relax.run.state.sampling_seed)


class RolloutResult(NamedTuple):
    samples: list[Sample]  # num_groups x sampling.n, prompt by prompt, scored
    metrics: dict[str, float]  # the rollout's own (dynamic sampling's rounds); the loop adds the reward metrics


class Rollout(Protocol):
    def __call__(self, request: RolloutRequest) -> RolloutResult: ...


@dataclass(frozen=True)
class DynamicSampling:
    """DAPO's dynamic sampling (relax.rollout.rollout.generate_groups)."""

    prompts_per_round: int  # --over-sampling-batch-size
    max_rounds: int  # --dynamic-sampling-max-rounds


@dataclass(frozen=True)
class GenerateAndScore:
    """The default rollout: `generate` (the engines) answers each prompt sampling.n times and `reward_fn` scores every
    response; with `dynamic_sampling`, whole rounds of new prompts until num_groups groups with unequal rewards are
    kept. A group with a sample the engine refused is dropped and generated anew from new prompts, in rounds
    (without dynamic sampling at most DEFAULT_MAX_ROUNDS): the step trains on a full batch, as the training
    batch's shape needs (whole optimizer steps of --global-batch-size samples)."""

    generate: Generate
    reward_fn: RewardFn
    dynamic_sampling: DynamicSampling | None = None

    def __call__(self, request: RolloutRequest) -> RolloutResult:
        dynamic = self.dynamic_sampling
        return RolloutResult(*generate_groups(
            self.generate, request.prompts, request.sampling, self.reward_fn, num_groups=request.num_groups,
            prompts_per_round=None if dynamic is None else dynamic.prompts_per_round,
            max_rounds=DEFAULT_MAX_ROUNDS if dynamic is None else dynamic.max_rounds,
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
