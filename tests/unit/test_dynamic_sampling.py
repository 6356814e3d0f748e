"""DAPO in the loop's collect_rollout: dynamic sampling (whole rounds of --over-sampling-batch-size prompts
until --rollout-batch-size informative groups are kept, bounded by --dynamic-sampling-max-rounds, every count
in the metrics) and the soft overlong penalty. The engines are replaced by a scripted `generate` (relax's own
phase, not SGLang) whose responses are the rewards to give."""

import pytest

from relax.args import RolloutSettings
from relax.run.loop import collect_rollout, rollout_of
from relax.rollout.data import Prompt, PromptLoader
from relax.rollout.engine import Completion, SamplingConfig
from relax.rollout.groups import FillError
from relax.rollout.rewards import RewardFn

REWARD_AS_WRITTEN = RewardFn(lambda sample: float(sample.response), "reward as written", False, False)


def _settings(**changes) -> RolloutSettings:
    base = dict(
        data=None, shuffle=False, reward_fn=None, reward_timeout=None,
        sampling=SamplingConfig(n=2, max_new_tokens=4), batch_size=3,
        devices_per_engine=1, dynamic_sampling=True, over_sampling_batch_size=3, dynamic_sampling_max_rounds=10,
        overlong_buffer_len=None, overlong_penalty_factor=1.0, load_data=None, save_data=None, routing_replay=False,
        context=None,
    )
    return RolloutSettings(**{**base, **changes})


@pytest.fixture
def scripted_generation():
    """Prompt [i]'s two samples score rewards[i] (a pair); records the prompt rows of each round."""
    rounds = []

    def install(rewards):
        def generate(prompts, sampling):
            rounds.append([prompt[0] for prompt in prompts])
            return [[Completion([7], [-1.0], "stop", str(value)) for value in rewards[prompt[0]]] for prompt in prompts]

        loader = PromptLoader([Prompt(row, [row], f"p{row}") for row in range(len(rewards))], shuffle=False)
        return generate, loader, rounds

    return install


def _collect(generate, loader, rollout):
    return collect_rollout(0, rollout_of(rollout, generate, REWARD_AS_WRITTEN), loader, SamplingConfig(n=2), rollout)


def test_groups_with_equal_rewards_are_dropped_and_rounds_refill(scripted_generation):
    # rows 0, 2, 3 and 5 teach nothing; 1, 4, 6 (and 7) do
    rewards = [(1, 1), (0, 1), (0, 0), (1, 1), (1, 0), (0, 0), (0.5, 1), (0, 1), (0, 0)]
    generate, loader, rounds = scripted_generation(rewards)
    samples, metrics = _collect(generate, loader, _settings())
    assert rounds == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # whole rounds of --rollout-batch-size prompts
    assert [s.prompt.row for s in samples] == [1, 1, 4, 4, 6, 6]  # prompt by prompt, in generation order
    assert metrics["rollout/kept_groups"] == 3 and metrics["rollout/generation_rounds"] == 3
    assert metrics["rollout/generated_groups"] == 9 and metrics["rollout/dropped_groups"] == 5
    assert metrics["rollout/surplus_groups"] == 1  # row 7: informative, but the batch was full
    assert metrics["rollout/informative_group_fraction"] == pytest.approx(4 / 9)
    # reward metrics describe the kept samples, the ones trained on
    assert metrics["rollout/reward_mean"] == pytest.approx((0 + 1 + 1 + 0 + 0.5 + 1) / 6)


def test_over_sampling_batch_size_sets_the_prompts_per_round(scripted_generation):
    generate, loader, rounds = scripted_generation([(0, 1)] * 10)
    samples, metrics = _collect(generate, loader, _settings(over_sampling_batch_size=5))
    assert rounds == [[0, 1, 2, 3, 4]]
    assert len(samples) == 6 and metrics["rollout/surplus_groups"] == 2 and metrics["rollout/generation_rounds"] == 1


def test_the_round_bound_stops_the_run_with_counts_instead_of_a_short_batch(scripted_generation):
    generate, loader, rounds = scripted_generation([(0, 1), (1, 1), (1, 1), (0, 0), (1, 1), (1, 1)] * 2)
    with pytest.raises(FillError) as info:
        _collect(generate, loader, _settings(dynamic_sampling_max_rounds=2))
    assert len(rounds) == 2
    message = str(info.value)
    assert "kept 1 of 3 groups after 2 rounds: 5 of 6 groups had equal rewards" in message
    assert "(by shared reward: {1.0: 4, 0.0: 1})" in message and "--dynamic-sampling-max-rounds" in message


def test_without_dynamic_sampling_every_group_is_kept(scripted_generation):
    generate, loader, rounds = scripted_generation([(1, 1), (0, 0), (0, 1)])
    samples, metrics = _collect(generate, loader, _settings(dynamic_sampling=False))
    assert rounds == [[0, 1, 2]] and len(samples) == 6
    assert "rollout/kept_groups" not in metrics


def test_without_dynamic_sampling_a_group_the_engine_failed_is_replaced_by_a_new_prompt(scripted_generation):
    generate, loader, rounds = scripted_generation([(1, 1), (0, 0), (0, 1), (1, 0)])

    def refusing_row_1(prompts, sampling):
        return [[Completion.refused("ValueError: too long")] * 2 if prompt[0] == 1 else group
                for prompt, group in zip(prompts, generate(prompts, sampling))]

    samples, metrics = _collect(refusing_row_1, loader, _settings(dynamic_sampling=False))
    assert rounds == [[0, 1, 2], [3]] and [s.prompt.row for s in samples] == [0, 0, 2, 2, 3, 3]
    assert metrics["rollout/failed_samples"] == 2 and metrics["rollout/failed_groups"] == 1
    assert metrics["rollout/reward_mean"] == pytest.approx(4 / 6)  # of the samples trained on


def test_overlong_penalty_comes_after_the_reward_metrics():
    def generate(prompts, sampling):
        return [[Completion([7], [-1.0], "stop", "1"), Completion([7] * 4, [-1.0] * 4, "length", "1")] for _ in prompts]

    loader = PromptLoader([Prompt(0, [0], "p0")])
    r = _settings(dynamic_sampling=False, batch_size=1, overlong_buffer_len=2)
    samples, metrics = _collect(generate, loader, r)
    assert [s.reward for s in samples] == [1.0, 1.0 - 1.0]  # 4 tokens of at most 4, the last 2 a buffer: -1
    assert metrics["rollout/reward_mean"] == 1.0  # the reward function's own
    r = _settings(dynamic_sampling=False, batch_size=1, overlong_buffer_len=2, overlong_penalty_factor=0.5)
    samples, _ = _collect(generate, PromptLoader([Prompt(0, [0], "p0")]), r)
    assert [s.reward for s in samples] == [1.0, 1.0 - 0.5]  # --overlong-penalty-factor 0.5: at most -0.5
