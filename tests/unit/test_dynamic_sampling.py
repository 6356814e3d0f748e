"""DAPO in the loop's collect_rollout: dynamic sampling (chunks of --over-sampling-batch-size prompts submitted
while fewer groups are in flight than still needed, until --rollout-batch-size informative groups are kept,
bounded by --rollout-max-prompts, every count in the metrics) and the soft overlong penalty. The engines are
replaced by a scripted engine pool (relax's own phase, not SGLang) whose responses are the rewards to give, each
group completing in submission order."""

import pytest

from relax.args import RolloutSettings
from relax.run.loop import collect_rollout, rollout_of
from relax.rollout.data import Prompt, PromptLoader
from relax.rollout.engine import Completion, SamplingConfig
from relax.rollout.groups import FillError
from relax.rollout.rewards import RewardFn
from relax.rollout.rollout import most_groups_in_flight
from relax.rollout.worker import GENERATION, MIN_GENERATION_THREADS, EngineWorker, engine_actor_class

REWARD_AS_WRITTEN = RewardFn(lambda sample: float(sample.response), "reward as written", False, False)


def _settings(**changes) -> RolloutSettings:
    base = dict(
        data=None, shuffle=False, reward_fn=None, reward_timeout=None,
        sampling=SamplingConfig(n=2, max_new_tokens=4), batch_size=3,
        devices_per_engine=1, dynamic_sampling=True, over_sampling_batch_size=3, max_prompts=30, partial=None,
        overlong_buffer_len=None, overlong_penalty_factor=1.0, load_data=None, save_data=None, routing_replay=False,
        context=None,
    )
    return RolloutSettings(**{**base, **changes})


class ScriptedPool:
    """An engine pool (relax.rollout.rollout.EnginePool): prompt [i]'s two samples score rewards[i] (a pair; a
    Completion stands for itself), or are refused for the rows in `refused`; groups complete in submission order, and the rows submitted are
    recorded, as are the aborts (after which the groups in flight come back aborted) and the most groups in flight."""

    weights_ahead = 0

    def __init__(self, rewards, refused=()):
        self.rewards, self.refused = rewards, set(refused)
        self.submitted, self.in_flight, self.aborts = [], {}, 0
        self.most_in_flight = 0

    def submit(self, key, prompt, sampling, prefixes=None, source=None):
        assert prefixes is None, "nothing is continued without --partial-rollout"
        self.submitted.append(prompt[0])
        self.in_flight[key] = prompt[0]
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))

    def next_done(self):
        key = min(self.in_flight)
        row = self.in_flight.pop(key)
        if self.aborts:
            return key, [Completion([], [], "abort", "0")] * 2
        if row in self.refused:
            return key, [Completion.refused("ValueError: too long")] * 2
        return key, [value if isinstance(value, Completion) else Completion([7], [-1.0], "stop", str(value))
                     for value in self.rewards[row]]

    def abort(self):
        self.aborts += 1


@pytest.fixture
def scripted_generation():
    def install(rewards, refused=()):
        loader = PromptLoader([Prompt(row, [row], f"p{row}") for row in range(len(rewards))], shuffle=False)
        return ScriptedPool(rewards, refused), loader

    return install


def _collect(pool, loader, rollout):
    return collect_rollout(0, rollout_of(rollout, pool, REWARD_AS_WRITTEN), loader, SamplingConfig(n=2), rollout)


def test_groups_with_equal_rewards_are_dropped_and_new_prompts_refill(scripted_generation):
    # rows 0, 2, 3 and 5 teach nothing; 1, 4, 6 (and 7) do
    rewards = [(1, 1), (0, 1), (0, 0), (1, 1), (1, 0), (0, 0), (0.5, 1), (0, 1), (0, 0)]
    pool, loader = scripted_generation(rewards)
    samples, metrics = _collect(pool, loader, _settings())
    assert pool.submitted == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # chunks of --over-sampling-batch-size prompts
    assert [s.prompt.row for s in samples] == [1, 1, 4, 4, 6, 6]  # prompt by prompt, in submission order
    assert metrics["rollout/kept_groups"] == 3 and metrics["rollout/submitted_groups"] == 9
    assert metrics["rollout/generated_groups"] == 7 and metrics["rollout/dropped_groups"] == 4
    # rows 7 and 8 were in flight when the batch was full: aborted, their prompts back in the stream
    assert (metrics["rollout/aborted_groups"], metrics["rollout/returned_prompts"], pool.aborts) == (2, 2, 1)
    assert [prompt.row for prompt in loader.take(2)] == [7, 8]
    assert metrics["rollout/informative_group_fraction"] == pytest.approx(3 / 7)
    # reward metrics describe the kept samples, the ones trained on
    assert metrics["rollout/reward_mean"] == pytest.approx((0 + 1 + 1 + 0 + 0.5 + 1) / 6)


def test_over_sampling_batch_size_sets_the_prompts_in_flight(scripted_generation):
    pool, loader = scripted_generation([(0, 1)] * 10)
    samples, metrics = _collect(pool, loader, _settings(over_sampling_batch_size=5))
    assert pool.submitted == [0, 1, 2, 3, 4]
    assert len(samples) == 6 and metrics["rollout/aborted_groups"] == 2 and metrics["rollout/submitted_groups"] == 5


def test_a_dropped_group_refills_up_to_the_most_groups_in_flight_the_engines_are_sized_for(scripted_generation):
    # row 0 teaches nothing: 2 in flight for the 3 still needed, so the next chunk of 3 goes at once
    pool, loader = scripted_generation([(1, 1)] + [(0, 1)] * 9)
    _collect(pool, loader, _settings(over_sampling_batch_size=3))
    assert pool.most_in_flight == most_groups_in_flight(num_groups=3, chunk_size=3) == 5
    assert engine_actor_class(EngineWorker, 5).__ray_metadata__.concurrency_groups == {
        GENERATION: MIN_GENERATION_THREADS}
    most = 2 * MIN_GENERATION_THREADS  # each group in flight and the abort
    assert engine_actor_class(EngineWorker, most).__ray_metadata__.concurrency_groups == {GENERATION: most + 1}


def test_the_prompt_bound_stops_the_run_with_counts_instead_of_a_short_batch(scripted_generation):
    pool, loader = scripted_generation([(0, 1), (1, 1), (1, 1), (0, 0), (1, 1), (1, 1)] * 2)
    with pytest.raises(FillError) as info:
        _collect(pool, loader, _settings(max_prompts=6))
    assert len(pool.submitted) == 6
    message = str(info.value)
    assert "kept 1 of 3 groups after submitting 6 prompts: 4 of 5 groups had equal rewards" in message
    assert "(by shared reward: {1.0: 3, 0.0: 1})" in message and "--rollout-max-prompts" in message


def test_without_dynamic_sampling_every_group_is_kept(scripted_generation):
    pool, loader = scripted_generation([(1, 1), (0, 0), (0, 1)])
    samples, metrics = _collect(pool, loader, _settings(dynamic_sampling=False))
    assert pool.submitted == [0, 1, 2] and len(samples) == 6
    assert "rollout/kept_groups" not in metrics


def test_without_dynamic_sampling_a_group_the_engine_failed_is_replaced_by_a_new_prompt(scripted_generation):
    pool, loader = scripted_generation([(1, 1), (0, 0), (0, 1), (1, 0), (1, 1), (0, 1)], refused={1})
    samples, metrics = _collect(pool, loader, _settings(dynamic_sampling=False))
    # the failure leaves fewer in flight than needed: the next chunk goes at once; its surplus is aborted
    assert pool.submitted == [0, 1, 2, 3, 4, 5] and [s.prompt.row for s in samples] == [0, 0, 2, 2, 3, 3]
    assert metrics["rollout/failed_samples"] == 2 and metrics["rollout/failed_groups"] == 1
    assert metrics["rollout/returned_prompts"] == 2
    assert metrics["rollout/reward_mean"] == pytest.approx(4 / 6)  # of the samples trained on


def test_overlong_penalty_comes_after_the_reward_metrics():
    rewards = [(1, Completion([7] * 4, [-1.0] * 4, "length", "1"))]
    loader = PromptLoader([Prompt(0, [0], "p0")])
    r = _settings(dynamic_sampling=False, batch_size=1, over_sampling_batch_size=1, overlong_buffer_len=2)
    samples, metrics = _collect(ScriptedPool(rewards), loader, r)
    assert [s.reward for s in samples] == [1.0, 1.0 - 1.0]  # 4 tokens of at most 4, the last 2 a buffer: -1
    assert metrics["rollout/reward_mean"] == 1.0  # the reward function's own
    r = _settings(dynamic_sampling=False, batch_size=1, over_sampling_batch_size=1, overlong_buffer_len=2,
                  overlong_penalty_factor=0.5)
    samples, _ = _collect(ScriptedPool(rewards), PromptLoader([Prompt(0, [0], "p0")]), r)
    assert [s.reward for s in samples] == [1.0, 1.0 - 0.5]  # --overlong-penalty-factor 0.5: at most -0.5
