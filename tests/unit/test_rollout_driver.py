"""relax.rollout.rollout with a scripted stand-in for the engine (the real engine: tests/e2e/test_engine.py)."""

import pytest

from relax.rollout.data import Prompt, PromptLoader
from relax.rollout.engine import Completion, SamplingConfig
from relax.rollout.rewards import load_reward_fn
from relax.rollout.rollout import RolloutConfig, rollout


class ScriptedEngine:
    """Answers prompt i with the texts script[i] (one per sample); records the batches it was sent."""

    def __init__(self, script):
        self.script = script
        self.batches = []

    def generate(self, prompts, sampling):
        self.batches.append(len(prompts))
        return [
            [
                Completion(token_ids=list(range(len(text))), logprobs=[-1.0] * len(text),
                           finish_reason="length" if len(text) >= sampling.max_new_tokens else "stop", text=text)
                for text in self.script[prompt[0]]
            ]
            for prompt in prompts
        ]


def prompts(count):
    return [Prompt(row=i + 1, token_ids=[i], text=f"copy {i}:", label=str(i)) for i in range(count)]


def test_rollout_groups_rewards_and_metrics():
    engine = ScriptedEngine({0: ["0", "1"], 1: ["1", "1x"]})
    config = RolloutConfig(sampling=SamplingConfig(n=2, max_new_tokens=2), num_prompts=2)
    result = rollout(engine, PromptLoader(prompts(2), shuffle=False), load_reward_fn("exact_match"), config)
    assert [g.prompt.label for g in result.groups] == ["0", "1"]
    assert [g.rewards for g in result.groups] == [[1.0, 0.0], [1.0, 0.0]]
    assert result.groups[1].samples[1].response_logprobs == [-1.0, -1.0]
    assert result.metrics["rollout/reward_mean"] == 0.5
    assert result.metrics["rollout/truncated_ratio"] == 0.25
    assert engine.batches == [2]  # one batched call


def test_rollout_dynamic_sampling_refills_from_the_loader():
    # prompts 0 and 2 give all-equal rewards and are dropped; 1 and 3 are kept
    engine = ScriptedEngine({0: ["0", "0"], 1: ["1", "2"], 2: ["5", "6"], 3: ["3", "x"]})
    config = RolloutConfig(sampling=SamplingConfig(n=2), num_prompts=2, dynamic_sampling=True)
    loader = PromptLoader(prompts(4), shuffle=False)
    result = rollout(engine, loader, load_reward_fn("exact_match"), config)
    assert [g.prompt.label for g in result.groups] == ["1", "3"]
    assert engine.batches == [2, 1, 1]
    assert result.metrics["rollout/dropped_groups"] == 2
    assert result.reward_report.samples == 8


def test_rollout_reward_failures_are_counted():
    def reward(sample):
        if sample.response == "boom":
            raise ValueError("bad")
        return 1.0

    from relax.rollout.rewards import RewardFn

    engine = ScriptedEngine({0: ["boom", "ok"]})
    config = RolloutConfig(sampling=SamplingConfig(n=2), num_prompts=1, reward_failure_score=-1.0)
    result = rollout(engine, PromptLoader(prompts(1)), RewardFn(reward, "r", False, False), config)
    assert result.groups[0].rewards == [-1.0, 1.0]
    assert result.groups[0].samples[0].reward_failed
    assert result.metrics["rollout/reward_failures"] == 1


def test_rollout_overlong_penalty_and_exhausted_data():
    engine = ScriptedEngine({0: ["0", "0abc"]})
    config = RolloutConfig(sampling=SamplingConfig(n=2, max_new_tokens=4), num_prompts=1, overlong_buffer_tokens=2)
    result = rollout(engine, PromptLoader(prompts(1)), load_reward_fn("exact_match"), config)
    assert result.groups[0].rewards == [1.0, 0.0 - 1.0]
    with pytest.raises(RuntimeError, match="prompt data ran out: 1 of 2 prompts left"):
        rollout(engine, PromptLoader(prompts(1), num_epochs=1), load_reward_fn("exact_match"),
                RolloutConfig(sampling=SamplingConfig(n=2), num_prompts=2))
