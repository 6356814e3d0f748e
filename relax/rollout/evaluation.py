"""Evaluation of the engines' policy on held-out prompt sets (--eval-prompt-data NAME PATH ...).

Each set's prompts are sampled K times each (--eval-n-samples-per-prompt) with the eval sampling settings and
scored by the run's reward function; the metrics of set NAME are, under eval/NAME/:

    reward_mean            the mean reward of all its samples
    pass@k                 for k in 1, 2, 4, ... up to K (and K itself): the chance that at least one of k samples
                           drawn from a prompt's K passes, averaged over prompts, by the unbiased estimator
                           1 - C(K - c, k) / C(K, k) (c: the prompt's passing samples; Chen et al., 2021)
    response_length_mean   tokens per response
    truncated_fraction     responses that reached the eval's max response length
    reward_failures        samples whose reward call raised or timed out (scored 0.0, as in a rollout)
    reward_timeouts        of those, the ones past --reward-timeout
    failed_samples         samples whose request the engine refused (relax.rollout.engine.Completion.error)
    failed_prompts         prompts with a failed sample: left out of every other metric, whose pass@k needs all K
                           samples of a prompt (the first reasons are printed); a set whose every prompt failed
                           logs these two only
    turns_mean, tool_calls, tool_failures, tool_timeouts, masked_token_share
                           with --tools, as the rollout's (relax.rollout.multi_turn.multi_turn_metrics)

With a custom generate function (--custom-generate-function-path) each of a prompt's K calls may return several
samples (its fan-out): every one is a sample of the prompt, as in a rollout. The per-sample metrics count them all,
and pass@k draws k of the prompt's own count (K or more), so a fanned-out call weighs as much as its samples.

A sample passes when it earns the full reward, PASSING_REWARD (the built-in rewards give 1.0 to a right answer
and less otherwise).

When (eval_due): at step 0, every `interval` steps, and after the last step; the metrics at step s are the
policy's after s training steps (the one step s's rollout samples from), so the last evaluation is logged at
step num_steps. Every evaluation of a set samples with the same seeds (eval_seed), so two evaluations differ
by the policy only.
"""

import math
import random
from dataclasses import dataclass, replace

from relax.console import say
from relax.rollout.data import LoadReport, Prompt, PromptDataConfig, PromptDataError, load_prompts
from relax.rollout.engine import SamplingConfig
from relax.rollout.groups import Sample, failure_reasons, group_by_prompt
from relax.rollout.multi_turn import multi_turn_metrics
from relax.rollout.rewards import RewardFn
from relax.rollout.rollout import Generate, generate_and_score

PASSING_REWARD = 1.0
METRIC_PREFIX = "eval/"


@dataclass(frozen=True)
class EvalSet:
    name: str  # the metrics' group: eval/<name>/...
    prompts: list[Prompt]


def load_eval_sets(datasets: dict[str, PromptDataConfig], tokenizer) -> tuple[list[EvalSet], list[LoadReport]]:
    """Every set read, checked and tokenized as prompt data is (relax.rollout.data.load_prompts); an error names
    the set besides the file and the row."""
    sets, reports = [], []
    for name, config in datasets.items():
        try:
            prompts, report = load_prompts(config, tokenizer)
        except PromptDataError as error:
            raise PromptDataError(f"--eval-prompt-data {name}: {error}") from None
        sets.append(EvalSet(name, prompts))
        reports.append(report)
    return sets, reports


def pass_at_k(num_samples: int, num_passing: int, k: int) -> float:
    """The unbiased estimate of pass@k from num_samples samples of which num_passing passed:
    1 - C(n - c, k) / C(n, k), the chance that k samples drawn without replacement include a passing one."""
    if not 1 <= k <= num_samples or not 0 <= num_passing <= num_samples:
        raise ValueError(f"pass@{k} of {num_passing} passing in {num_samples} samples: need 1 <= k <= n, 0 <= c <= n")
    if num_samples - num_passing < k:  # every draw of k holds a passing sample
        return 1.0
    return 1.0 - math.comb(num_samples - num_passing, k) / math.comb(num_samples, k)


def pass_ks(samples_per_prompt: int) -> list[int]:
    """The k of pass@k reported for K samples per prompt: the powers of two below K, and K."""
    ks = [1 << i for i in range(samples_per_prompt.bit_length()) if 1 << i < samples_per_prompt]
    return ks + [samples_per_prompt]


def eval_metrics(name: str, samples: list[Sample], samples_per_prompt: int) -> dict[str, float]:
    """The eval/<name>/ metrics (module docstring) of samples listed prompt by prompt, samples_per_prompt each or
    more (a custom generate function's fan-out: relax.rollout.groups.group_sizes)."""
    prefix = f"{METRIC_PREFIX}{name}/"
    groups = group_by_prompt(samples, samples_per_prompt)
    scored = [group for group in groups if not group.failed]
    metrics = {
        f"{prefix}failed_samples": float(sum(s.failure is not None for s in samples)),
        f"{prefix}failed_prompts": float(len(groups) - len(scored)),
    }
    if not scored:
        return metrics
    samples = [sample for group in scored for sample in group.samples]
    passing = [(len(group.samples), sum(s.reward >= PASSING_REWARD for s in group.samples)) for group in scored]
    metrics[f"{prefix}reward_mean"] = sum(s.reward for s in samples) / len(samples)
    for k in pass_ks(samples_per_prompt):  # a group with fan-out draws k of its own (larger) count
        metrics[f"{prefix}pass@{k}"] = sum(pass_at_k(size, c, k) for size, c in passing) / len(scored)
    metrics[f"{prefix}response_length_mean"] = sum(len(s.response_token_ids) for s in samples) / len(samples)
    metrics[f"{prefix}truncated_fraction"] = sum(s.finish_reason == "length" for s in samples) / len(samples)
    metrics[f"{prefix}reward_failures"] = float(sum(s.reward_failed for s in samples))
    metrics[f"{prefix}reward_timeouts"] = float(sum(s.reward_timed_out for s in samples))
    if samples[0].tool_use is not None:  # multi-turn samples (--tools)
        metrics.update(multi_turn_metrics([s.tool_use for s in samples], [s.loss_mask for s in samples], prefix))
    return metrics


def eval_due(step: int, num_steps: int, interval: int | None) -> bool:
    """Whether the policy after `step` training steps is evaluated: at 0, every `interval` steps (None: no steps
    between) and at num_steps, after the last step."""
    return step == 0 or step == num_steps or (interval is not None and step % interval == 0)


def eval_seed(seed: int, name: str) -> int:
    """The first per-request sampling seed of set `name`'s evaluations: a function of (--seed, name) only, the same
    at every evaluation. Its requests use this seed + their index, below 2**24 (like a step's rollout)."""
    return random.Random(f"{seed}:eval:{name}").getrandbits(38) << 24


def evaluate(generate: Generate, eval_sets: list[EvalSet], sampling: SamplingConfig, reward_fn: RewardFn, seed: int):
    """The eval/ metrics of every set: its prompts sampled sampling.n times each (seeded by eval_seed) and scored."""
    metrics = {}
    for eval_set in eval_sets:
        set_sampling = replace(sampling, seed=eval_seed(seed, eval_set.name))
        samples = generate_and_score(generate, eval_set.prompts, set_sampling, reward_fn)
        metrics.update(eval_metrics(eval_set.name, samples, sampling.n))
        reasons = failure_reasons(samples)
        if reasons:
            say(
                f"relax: evaluation {eval_set.name!r}: the engine refused "
                f"{sum(s.failure is not None for s in samples)} of {len(samples)} samples; their prompts are left "
                f"out of its metrics (eval/{eval_set.name}/failed_prompts); first reasons: {' | '.join(reasons)}",
                error=True,
            )
    return metrics
