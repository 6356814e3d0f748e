"""relax.rollout.rollout with a scripted `generate` in place of the engines (the real engine:
tests/e2e/test_engine.py; the loop's collect_rollout around it: tests/unit/test_dynamic_sampling.py)."""

import asyncio

import pytest

from relax.rollout.data import Prompt, PromptLoader
from relax.rollout.engine import Completion, SamplingConfig
from relax.rollout.groups import AllSamplesFailed, group_by_prompt
from relax.rollout.rewards import RewardFn, load_reward_fn
from relax.rollout.rollout import (
    ROUND_SEED_STRIDE,
    generate_and_score,
    generate_groups,
    reward_and_length_metrics,
    take_prompts,
)


class ScriptedGenerate:
    """Answers prompt [i] with the texts script[i] (one per sample; a text "refused: why" is a request the engine
    refused with that error); records each call's prompts and seed."""

    def __init__(self, script):
        self.script = script
        self.calls = []

    def __call__(self, prompts, sampling):
        self.calls.append(([prompt[0] for prompt in prompts], sampling.seed))
        return [
            [
                Completion.refused(text.removeprefix("refused: ")) if text.startswith("refused: ") else
                Completion(token_ids=list(range(len(text))), logprobs=[-1.0] * len(text),
                           finish_reason="length" if len(text) >= sampling.max_new_tokens else "stop", text=text)
                for text in self.script[prompt[0]]
            ]
            for prompt in prompts
        ]


def prompts(count):
    return [Prompt(row=i + 1, token_ids=[i], text=f"copy {i}:", label=str(i)) for i in range(count)]


def test_samples_come_scored_prompt_by_prompt_with_their_metrics():
    generate = ScriptedGenerate({0: ["0", "1"], 1: ["1", "1x"]})
    sampling = SamplingConfig(n=2, max_new_tokens=2)
    samples = generate_and_score(generate, prompts(2), sampling, load_reward_fn("exact_match"))
    groups = group_by_prompt(samples, 2)
    assert [g.prompt.label for g in groups] == ["0", "1"]
    assert [g.rewards for g in groups] == [[1.0, 0.0], [1.0, 0.0]]
    assert [s.response_text for s in samples] == ["0", "1", "1", "1x"]
    assert groups[1].samples[1].response_logprobs == [-1.0, -1.0]
    assert [s.loss_mask for s in samples] == [[1], [1], [1], [1, 1]]  # every response token trained
    metrics = reward_and_length_metrics(samples)
    assert metrics["rollout/reward_mean"] == 0.5 and metrics["rollout/reward_std"] == pytest.approx(0.57735, abs=1e-5)
    assert metrics["rollout/response_length_mean"] == 1.25 and metrics["rollout/response_length_max"] == 2
    assert metrics["rollout/truncated_fraction"] == 0.25 and metrics["rollout/reward_failures"] == 0
    assert (metrics["rollout/response_tokens"], metrics["rollout/prompt_tokens"]) == (5, 4)
    assert generate.calls == [([0, 1], None)]  # one batched call


def test_a_generate_that_loses_a_prompt_is_an_error():
    generate = ScriptedGenerate({0: ["0"], 1: ["1"]})
    with pytest.raises(ValueError, match="zip"):
        generate_and_score(lambda ids, sampling: generate(ids, sampling)[:1], prompts(2), SamplingConfig(n=1),
                           load_reward_fn("exact_match"))


def test_dynamic_sampling_refills_from_the_loader_with_new_seeds_each_round():
    # prompts 0 and 2 give all-equal rewards and are dropped; 1 and 3 are kept
    generate = ScriptedGenerate({0: ["0", "0"], 1: ["1", "2"], 2: ["5", "6"], 3: ["3", "x"]})
    loader = PromptLoader(prompts(4), shuffle=False)
    samples, metrics = generate_groups(
        generate, loader, SamplingConfig(n=2, seed=5), load_reward_fn("exact_match"),
        num_groups=2, prompts_per_round=2, max_rounds=10,
    )
    assert [s.prompt.label for s in samples] == ["1", "1", "3", "3"]
    assert generate.calls == [([0, 1], 5), ([2, 3], 5 + ROUND_SEED_STRIDE)]  # whole rounds, every sample scored
    assert metrics["rollout/dropped_groups"] == 2 and metrics["rollout/generation_rounds"] == 2


def test_a_refused_request_is_a_failed_sample_that_is_not_scored():
    scored = []

    def reward(sample):
        scored.append(sample.response)
        return 1.0

    samples = generate_and_score(ScriptedGenerate({0: ["0", "refused: ValueError: too long"]}), prompts(1),
                                 SamplingConfig(n=2), RewardFn(reward, "r", False, False))
    assert scored == ["0"]
    assert [s.failure for s in samples] == [None, "ValueError: too long"]
    assert (samples[1].response_token_ids, samples[1].finish_reason, samples[1].reward) == ([], "error", 0.0)


@pytest.mark.parametrize("prompts_per_round", [None, 3])
def test_a_failed_sample_fails_its_group_which_new_prompts_replace(prompts_per_round, capsys):
    # prompt 1 has a refused sample; without dynamic sampling one new prompt replaces it, with it a whole round
    script = {0: ["0", "1"], 1: ["1", "refused: E1"], 2: ["2", "x"], 3: ["refused: E2", "3"], 4: ["4", "x"],
              5: ["5", "x"]}
    generate = ScriptedGenerate(script)
    samples, metrics = generate_groups(
        generate, PromptLoader(prompts(6), shuffle=False), SamplingConfig(n=2, seed=5), load_reward_fn("exact_match"),
        num_groups=3, prompts_per_round=prompts_per_round, max_rounds=10,
    )
    assert all(s.failure is None for s in samples) and len(samples) == 6
    if prompts_per_round is None:
        assert generate.calls == [([0, 1, 2], 5), ([3], 5 + ROUND_SEED_STRIDE), ([4], 5 + 2 * ROUND_SEED_STRIDE)]
        assert [s.prompt.label for s in samples[::2]] == ["0", "2", "4"]
        assert "rollout/generation_rounds" not in metrics
    else:
        assert generate.calls == [([0, 1, 2], 5), ([3, 4, 5], 5 + ROUND_SEED_STRIDE)]
        assert [s.prompt.label for s in samples[::2]] == ["0", "2", "4"]
        assert metrics["rollout/surplus_groups"] == 1 and metrics["rollout/dropped_groups"] == 0
    assert (metrics["rollout/failed_samples"], metrics["rollout/failed_groups"]) == (2, 2)
    printed = capsys.readouterr().err
    assert printed.count("failed in the engine") == 1  # once for the step, not per round
    assert "2 samples in 2 groups failed in the engine (first reasons: E1 | E2); their groups were dropped" in printed


def test_a_step_whose_every_sample_fails_fails_naming_the_reason():
    generate = ScriptedGenerate({i: ["refused: ValueError: The input (9 tokens) is longer"] * 2 for i in range(4)})
    with pytest.raises(AllSamplesFailed, match=r"every one of the 4 samples of this step; first: ValueError: The inp"):
        generate_groups(generate, PromptLoader(prompts(4), shuffle=False), SamplingConfig(n=2),
                        load_reward_fn("exact_match"), num_groups=2, prompts_per_round=None, max_rounds=10)


def test_reward_failures_are_counted_and_their_reasons_printed(capsys):
    def reward(sample):
        if sample.response == "boom":
            raise ValueError("bad")
        return 1.0

    samples = generate_and_score(ScriptedGenerate({0: ["boom", "ok"]}), prompts(1), SamplingConfig(n=2),
                                 RewardFn(reward, "r", False, False))
    assert [s.reward for s in samples] == [0.0, 1.0]  # the failure score
    assert [s.reward_failed for s in samples] == [True, False]
    assert reward_and_length_metrics(samples)["rollout/reward_failures"] == 1
    printed = capsys.readouterr().err
    assert "reward function 'r' failed on 1 of 2 samples (0 by timing out; each scored 0.0)" in printed
    assert "sample 0: ValueError: bad" in printed


def test_reward_timeouts_are_failures_counted_on_their_own(capsys):
    async def reward(sample):
        if sample.response == "hang":
            await asyncio.sleep(3600)
        return 1.0

    samples = generate_and_score(ScriptedGenerate({0: ["ok", "hang"], 1: ["hang", "ok"]}), prompts(2),
                                 SamplingConfig(n=2), RewardFn(reward, "r", False, True, timeout=0.2))
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 1.0]
    assert [s.reward_timed_out for s in samples] == [s.reward_failed for s in samples] == [False, True, True, False]
    metrics = reward_and_length_metrics(samples)
    assert metrics["rollout/reward_timeouts"] == metrics["rollout/reward_failures"] == 2
    printed = capsys.readouterr().err
    assert "failed on 2 of 4 samples (2 by timing out; each scored 0.0)" in printed
    assert "sample 1: timed out: no score within 0.2 s; sample 2: timed out" in printed


def test_a_loader_that_runs_out_is_an_error_not_a_short_batch():
    assert [p.row for p in take_prompts(PromptLoader(prompts(2), shuffle=False, num_epochs=1), 2)] == [1, 2]
    with pytest.raises(RuntimeError, match="prompt data ran out: 1 of 2 prompts left"):
        take_prompts(PromptLoader(prompts(1), num_epochs=1), 2)
