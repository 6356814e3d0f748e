"""The rollout phase, wherever the engines run: prompts -> sampling.n responses each -> rewards -> samples, group by
group as the engines complete them, with over-sampling, DAPO dynamic sampling and the rollout metrics.

A step's rollout drives an EnginePool: each prompt group (its sampling.n requests) is one submission, which the pool
sends whole to one engine (the one with the least work in flight: relax.run.colocation.Colocation; the engines'
prefix cache serves the group's shared prompt), and completed groups come back one by one, in the order they
complete. collect_groups decides what to submit, keep, drop, abort and put back.

`generate(prompts, sampling)` (a Generate) answers a whole list of prompts (their token ids, and their data rows for
a custom generate function) at once, prompt p's requests sampled with seeds sampling.seed + p x n + j:
Colocation.generate over the engine actors (the evaluation's).

    samples = generate_and_score(colocation.generate, loader.take(32), sampling, reward_fn)
    metrics = reward_and_length_metrics(samples)
"""

from dataclasses import replace
from typing import Callable, NamedTuple, Protocol

import torch

from relax.console import say
from relax.rollout.data import Prompt, PromptLoader
from relax.rollout.engine import Completion, SamplingConfig
from relax.rollout.groups import REFUSAL_FIX, AllSamplesFailed, FillError, FillStats, Group, Sample
from relax.rollout.multi_turn import multi_turn_metrics
from relax.rollout.partial import GroupSoFar, PartialStats, ResponseSoFar
from relax.rollout.rewards import RewardFn, RewardInput, RewardReport, score

Generate = Callable[[list[Prompt], SamplingConfig], list[list[Completion]]]

STEP_SEED_SPAN = 2**24  # sampling seeds per step (run_state.sampling_seed): a step's requests must fit
DEFAULT_MAX_CHUNKS = 10  # --rollout-max-prompts when not given: this many --over-sampling-batch-size chunks


class EnginePool(Protocol):
    """The engines as a rollout drives them, one prompt group per submission."""

    def submit(self, key: int, prompt: list[int], sampling: SamplingConfig,
               prefixes: list[ResponseSoFar] | None = None, source: Prompt | None = None,
               evaluation: bool = False) -> None:
        """Start sampling.n requests of `prompt` (request j seeded sampling.seed + j), known as `key`; or with
        `prefixes` (partial rollout), one request per response begun earlier, continuing it (its completion: what
        it generated since). `source`: the prompt's data row, which a custom generate function reads
        (relax.rollout.custom_generate); `evaluation`: the group is an evaluation's, which the function is told."""

    def next_done(self) -> tuple[int, list[Completion]]:
        """Wait for the next submitted group to complete: its key and a completion per request."""

    def abort(self) -> None:
        """End every group in flight soon (SGLang's abort): each still comes back through next_done, its aborted
        requests with finish_reason "abort"."""

    # Steps the engines' weights are ahead of those the rollout's step samples with by the loop's schedule (0 but
    # where relax.run.loop_async gave them the step's trained weights mid-rollout: relax.run.colocation); a group's
    # tokens are recorded as sampled in that many steps after the rollout's own (relax.rollout.partial).
    weights_ahead: int


def samples_of(prompts: list[Prompt], completions: list[list[Completion]]) -> list[Sample]:
    """Unscored samples of each prompt's completions (sampling.n, or more: a custom generate function's fan-out),
    prompt by prompt."""
    return [
        Sample(
            prompt, c.token_ids, c.logprobs, c.finish_reason, c.text, routed_experts=c.routed_experts,
            loss_mask=c.loss_mask, tool_use=c.tool_use, failure=c.error, **_preset_reward(c.reward),
            own_prompt_ids=c.prompt_ids, group_size=len(prompt_completions),
        )
        for prompt, prompt_completions in zip(prompts, completions, strict=True)
        for c in prompt_completions
    ]


def _preset_reward(reward: float | None) -> dict:
    """A Sample's reward fields for a reward a custom generate function set (None: none set)."""
    return {} if reward is None else {"reward": reward, "reward_preset": True}


def score_samples(samples: list[Sample], reward_fn: RewardFn) -> RewardReport:
    """Score each sample in place, but the failed ones (the engine refused their request: Sample.failure, no
    response), which the caller handles, and those whose custom generate function set their reward; the reward
    function's failures are reported, not printed."""
    responses = [s for s in samples if s.failure is None and not s.reward_preset]
    scores, failed, report = score(reward_fn, [
        RewardInput(s.prompt.text, s.response_text, s.prompt.label, s.prompt.metadata, s.finish_reason)
        for s in responses
    ])
    for sample, value, was_failure in zip(responses, scores, failed):
        sample.reward, sample.reward_failed = value, was_failure
    for index in report.timed_out:
        responses[index].reward_timed_out = True
    return report


def say_reward_failures(reward_fn: RewardFn, report: RewardReport) -> None:
    """Scored 0 and counted in the metrics; the reasons must reach the user too."""
    if report.failures:
        say(
            f"relax: reward function {reward_fn.name!r} failed on {report.failures} of {report.samples} samples "
            f"({len(report.timed_out)} by timing out; each scored 0.0); first: {'; '.join(report.errors[:3])}",
            error=True,
        )


def generate_and_score(
    generate: Generate, prompts: list[Prompt], sampling: SamplingConfig, reward_fn: RewardFn
) -> list[Sample]:
    """sampling.n samples per prompt (or more: a custom generate function's fan-out; Sample.group_size), prompt by
    prompt in prompt order; each scored, but the failed ones (score_samples)."""
    samples = samples_of(prompts, generate(prompts, sampling))
    say_reward_failures(reward_fn, score_samples(samples, reward_fn))
    return samples


def take_prompts(loader: PromptLoader, count: int) -> list[Prompt]:
    """The loader's next `count` prompts; a loader that runs out is an error, never a short batch."""
    prompts = loader.take(count)
    if len(prompts) < count:
        raise RuntimeError(f"prompt data ran out: {len(prompts)} of {count} prompts left (loader at {loader.position})")
    return prompts


def rollout_seeds_problem(max_prompts: int, n: int) -> str | None:
    """Why a step that may submit `max_prompts` prompts of n requests each would not fit the step's sampling seeds
    (STEP_SEED_SPAN), or None."""
    if max_prompts * n > STEP_SEED_SPAN:
        return (
            f"--rollout-max-prompts {max_prompts} x --n-samples-per-prompt {n} is more requests than a step has "
            f"sampling seeds for ({STEP_SEED_SPAN}); give at most {STEP_SEED_SPAN // n} prompts"
        )
    return None


def offset_seed(sampling: SamplingConfig, offset: int) -> SamplingConfig:
    """`sampling` numbering its requests' seeds from sampling.seed + offset (no seed: unchanged)."""
    return sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + offset)


class Partial(NamedTuple):
    """--partial-rollout: groups aborted when the batch is full are put back with what they generated, and a later
    step continues them (relax.rollout.partial); --max-staleness bounds their tokens' age."""

    max_staleness: int | None


def collect_groups(
    pool: EnginePool, loader: PromptLoader, sampling: SamplingConfig, reward_fn: RewardFn, num_groups: int,
    chunk_size: int, dynamic_sampling: bool, max_prompts: int, step: int = 0, partial: Partial | None = None,
) -> tuple[list[Sample], dict[str, float]]:
    """`num_groups` scored groups of new prompts, taken as the engines complete them, for step `step`.

    While fewer groups are in flight than are still needed, the next `chunk_size` prompts of `loader` are submitted
    (--over-sampling-batch-size: with chunk_size > num_groups, more are generated than the step needs, against the
    long tail). Each completed group is scored and kept, unless a sample of it failed in the engine (dropped and
    counted: its place is taken by the groups in flight or the next chunk), a custom generate function returned a
    sample of it ABORTED (unscored, counted, its prompt put back with the surplus's) or, with `dynamic_sampling`
    (DAPO), its rewards are all equal (dropped). Once num_groups are kept, every group still in flight is aborted and
    its prompt put back into `loader`, to be served first by the next step (nothing is lost; no prompt comes twice in
    a step).
    With `partial`, a group is put back with the tokens its responses generated, and taken again its responses
    continue from there (those that had finished are kept as they are).

    The batch: the kept groups in submission order (each of sampling.n samples, or more where a custom generate
    function's calls fanned out: the batch is full at num_groups groups, whatever their samples), so that without
    over-sampling or failures it is the loader's next num_groups prompts. The k-th prompt the step submits samples its
    request j with seed sampling.seed + k * n + j (distinct seeds within the step's STEP_SEED_SPAN). Fails (FillError)
    with the counts once `max_prompts` prompts were submitted, or the loader runs out, short of the batch;
    AllSamplesFailed once a batch's worth of groups has completed with every sample failed. Returns the samples and the
    rollout metrics; the engine's and the reward function's failure reasons are printed once."""
    problem = rollout_seeds_problem(max_prompts, sampling.n)
    if problem:
        raise ValueError(problem)
    stats, rewards, partial_stats = FillStats(), RewardReport(), PartialStats()
    submitted: list[tuple[Prompt, GroupSoFar]] = []  # by submission order: a group's key is its index
    continued: dict[int, list[int]] = {}  # the responses each group in flight (or ready) generates, by key
    ready: list[int] = []  # groups taken back complete: nothing to generate, in flight all the same
    kept: dict[int, Group] = {}
    aborted_by_function: list[int] = []  # groups with a sample a custom generate function returned ABORTED

    def submit_chunk():
        count = min(chunk_size, max_prompts - len(submitted))
        taken = loader.take_with_progress(count) if count else []
        if not taken:
            raise FillError(_short_batch(stats, len(kept), num_groups, max_prompts, dynamic_sampling, count > 0))
        for prompt, so_far in taken:
            key = len(submitted)
            if so_far is not None:
                partial_stats.stale_samples += so_far.drop_stale(step, partial.max_staleness)
            if so_far is None or not so_far.begun:  # nothing to continue (a fan-out's responses too): a new group
                so_far = GroupSoFar.new(sampling.n)
            submitted.append((prompt, so_far))
            continued[key] = so_far.to_continue(sampling.max_new_tokens_for(len(prompt.token_ids)))
            if not continued[key]:  # every response had finished
                ready.append(key)
                continue
            prefixes = [so_far.responses[j] for j in continued[key]] if so_far.begun else None
            pool.submit(key, prompt.token_ids, offset_seed(sampling, key * sampling.n), prefixes, source=prompt)
        stats.groups_submitted = len(submitted)

    def take_back(key: int, completions: list[Completion]) -> GroupSoFar:
        """Group `key` with its completions: its responses continued, in order. Calls of a custom generate function
        that fanned out give more completions than requests: those after one per request (the worker's order:
        EngineWorker.generate_custom_group) are new responses of the group."""
        indices, so_far = continued.pop(key), submitted[key][1]
        if len(completions) < len(indices):
            raise RuntimeError(f"a group came back with {len(completions)} completions for {len(indices)} requests")
        fanned_out = len(completions) - len(indices)
        indices += range(len(so_far.responses), len(so_far.responses) + fanned_out)
        so_far.responses += [ResponseSoFar() for _ in range(fanned_out)]
        partial_stats.restarted_calls += sum(completion.restarted for completion in completions)
        for j, completion in zip(indices, completions):
            so_far.responses[j] = so_far.responses[j].extended(completion, step + pool.weights_ahead)
        return so_far

    def abort_and_put_back():
        """Abort the groups in flight, wait for each to come back and put them back, in submission order: their
        prompts, and with `partial` what their responses generated."""
        returned = sorted([*continued, *aborted_by_function])  # with the groups ready
        for key in ready:
            take_back(key, [])
        ready.clear()
        if continued:
            pool.abort()
        while continued:
            key, completions = pool.next_done()
            take_back(key, completions)
            stats.groups_aborted += any(c.finish_reason == "abort" for c in completions)
        progress = [_carried(submitted[key][1]) if partial is not None else None for key in returned]
        partial_stats.carried_tokens += sum(len(r.token_ids) for group in progress if group for r in group.responses)
        loader.put_back([submitted[key][0] for key in returned], progress)
        stats.prompts_returned += len(returned)

    try:
        while len(kept) < num_groups:
            if len(continued) < num_groups - len(kept):
                submit_chunk()
                continue
            key, completions = (ready.pop(0), []) if ready else pool.next_done()
            so_far = take_back(key, completions)
            group = Group(submitted[key][0], samples_of_group(submitted[key][0], so_far, step))
            partial_stats.resumed_samples += sum(s.response_steps is not None for s in group.samples)
            stats.groups_completed += 1
            stats.samples_generated += len(group.samples)
            if group.failed:
                stats.count_failures(group)
            elif any(sample.finish_reason == "abort" for sample in group.samples):
                # Only a custom generate function's ABORTED sample comes back so before the step's abort: unscored,
                # its prompt goes back for a later step (abort_and_put_back)
                stats.samples_aborted_by_function += sum(s.finish_reason == "abort" for s in group.samples)
                aborted_by_function.append(key)
            else:
                rewards.add(score_samples(group.samples, reward_fn))
                equal_rewards = group.rewards_all_equal()
                if equal_rewards:
                    stats.count_equal_rewards(group)
                if not (dynamic_sampling and equal_rewards):  # dynamic sampling drops them
                    kept[key] = group
            if stats.samples_failed == stats.samples_generated and stats.groups_completed >= num_groups:
                raise AllSamplesFailed(
                    f"the engine refused every one of the {stats.samples_generated} samples of this step; first: "
                    f"{stats.failures[0]}; {REFUSAL_FIX}"
                )
    except FillError:  # the engines end what they still run (the run may go on: --max-restarts)
        abort_and_put_back()
        raise
    abort_and_put_back()  # the batch is full: the rest is surplus
    stats.groups_kept = len(kept)
    say_reward_failures(reward_fn, rewards)
    if stats.groups_failed:
        say(f"relax: {stats.failures_text()}; their groups were dropped and generated anew from other prompts",
            error=True)
    samples = [sample for key in sorted(kept) for sample in kept[key].samples]
    metrics = stats.metrics(dynamic_sampling)
    fan_out = len(samples) - len(kept) * sampling.n
    if fan_out:  # only a custom generate function's calls fan out: its groups' samples beyond sampling.n each
        metrics["rollout/fan_out_samples"] = fan_out
    if partial is not None:
        old = [token_step for s in samples for token_step in s.response_steps or () if token_step < step]
        metrics.update(partial_stats.metrics(old, sum(len(s.response_token_ids) for s in samples), step))
    if samples and samples[0].tool_use is not None:  # multi-turn samples (--tools)
        metrics.update(multi_turn_metrics([s.tool_use for s in samples], [s.loss_mask for s in samples]))
    return samples, metrics


def samples_of_group(prompt: Prompt, group: GroupSoFar, step: int) -> list[Sample]:
    """The unscored samples of a group's responses in step `step` (those begun in an earlier step with the step of
    each token: Sample.response_steps)."""
    return [
        Sample(
            prompt, r.token_ids, r.logprobs, r.finish_reason, r.text, routed_experts=r.routed_experts,
            loss_mask=r.loss_mask, tool_use=r.tool_use, failure=r.error, **_preset_reward(r.reward),
            response_steps=r.steps if r.steps and r.steps[0] < step else None, own_prompt_ids=r.prompt_ids,
            group_size=len(group.responses),
        )
        for r in group.responses
    ]


def _carried(group: GroupSoFar) -> GroupSoFar | None:
    """What a later step continues of a group put back (its aborted and refused requests go on from their tokens),
    or None when none of its responses had a token (it goes back as its bare prompt)."""
    carried = GroupSoFar([response.to_continue_later() for response in group.responses])
    return carried if carried.begun else None


def _short_batch(stats: FillStats, kept: int, num_groups: int, max_prompts: int, dynamic_sampling: bool,
                 ran_out: bool) -> str:
    """Why the step could not keep num_groups groups: the counts, and the fix."""
    if ran_out:
        return f"prompt data ran out while filling the step's groups with {kept} of {num_groups} kept"
    why = [f"{stats.failures_text()}; their groups were dropped"] if stats.groups_failed else []
    if stats.samples_aborted_by_function:
        why.append(f"the custom generate function returned {stats.samples_aborted_by_function} samples ABORTED; "
                   "their prompts were put back")
    if dynamic_sampling:
        why.append(
            f"{stats.groups_equal_rewards} of {stats.groups_completed} groups had equal rewards (by shared reward: "
            f"{stats.equal_rewards_by_reward}). The task is too easy or too hard for the model, or the reward is "
            "broken; raise the bound (--rollout-max-prompts) or turn dynamic sampling off"
        )
    else:
        why.append(REFUSAL_FIX)
    return f"kept {kept} of {num_groups} groups after submitting {max_prompts} prompts: " + "; ".join(why)


def most_groups_in_flight(num_groups: int, chunk_size: int) -> int:
    """The most groups collect_groups has submitted and not taken back at once: it submits the next `chunk_size`
    only while fewer are in flight than the `num_groups` it still needs (at most num_groups - 1)."""
    return num_groups + chunk_size - 1


def most_requests_per_engine(num_prompts: int, n: int, num_engines: int) -> int:
    """The most requests one engine holds at once when `num_prompts` groups of `n` requests are in flight over
    `num_engines` engines, each group sent to the engine with the least in flight: ceil(num_prompts / num_engines)
    groups."""
    return -(-num_prompts // num_engines) * n


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
        "rollout/prompt_tokens": float(sum(len(s.prompt_ids) for s in samples)),  # each sample's own prompt
        "rollout/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
