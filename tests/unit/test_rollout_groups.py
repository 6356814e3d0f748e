import pytest

from relax.rollout.data import Prompt
from relax.rollout.groups import (
    AllSamplesFailed,
    FillError,
    Group,
    Sample,
    apply_overlong_penalty,
    fill_groups,
    group_by_prompt,
    overlong_penalty,
)


def make_group(rewards, row=1):
    prompt = Prompt(row=row, token_ids=[1], text="p")
    return Group(prompt, [Sample(prompt, [5], [0.0], "stop", reward=r) for r in rewards])


def test_group_by_prompt():
    a, b = Prompt(1, [1], "a"), Prompt(2, [2], "b")
    samples = [Sample(p, [3], [0.0], "stop") for p in (a, a, b, b)]
    groups = group_by_prompt(samples, 2)
    assert [g.prompt for g in groups] == [a, b] and all(len(g.samples) == 2 for g in groups)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        group_by_prompt(samples, 3)
    with pytest.raises(ValueError, match="do not share one prompt"):
        group_by_prompt([samples[0], samples[2]], 2)


def test_dynamic_sampling_drops_equal_groups_and_refills():
    rounds = iter(
        [
            [make_group([1, 1]), make_group([0, 1]), make_group([0, 0]), make_group([0.5, 0])],  # 2 kept of 4
            [make_group([0, 0]), make_group([1, 0])],  # 1 kept
            [make_group([0.2, 0.3])],
        ]
    )
    requested = []

    def generate(count):
        requested.append(count)
        return next(rounds)

    groups, stats = fill_groups(generate, num_groups=4)
    assert requested == [4, 2, 1]
    assert len(groups) == 4 and not any(g.rewards_all_equal() for g in groups)
    assert (stats.rounds, stats.groups_generated, stats.groups_kept, stats.groups_dropped) == (3, 7, 4, 3)
    assert stats.dropped_by_reward == {1: 1, 0: 2}
    metrics = stats.metrics(dynamic_sampling=True)
    assert metrics["rollout/kept_groups"] == 4 and metrics["rollout/generation_rounds"] == 3


def test_dynamic_sampling_gives_up_with_statistics():
    with pytest.raises(FillError, match=r"kept 0 of 2 groups after 3 rounds: 6 of 6 groups had equal"):
        fill_groups(lambda count: [make_group([1, 1])] * count, num_groups=2, max_rounds=3)
    with pytest.raises(FillError, match="prompt data ran out"):
        fill_groups(lambda count: [], num_groups=2)


def failed_group(*reasons, row=1):
    """A group of one sample per reason: None answered (reward 1), a text refused by the engine."""
    group = make_group([1.0] * len(reasons), row)
    for sample, reason in zip(group.samples, reasons):
        sample.failure = reason
    return group


@pytest.mark.parametrize("informative_only", [False, True])
def test_a_group_with_a_failed_sample_is_dropped_counted_and_refilled(informative_only):
    rounds = iter([
        [make_group([0, 1]), failed_group(None, "E1"), failed_group("E2", "E1")],  # 1 kept, 2 failed
        [make_group([1, 0])],  # the refill
    ])
    requested = []

    def generate(count):
        requested.append(count)
        return next(rounds)

    groups, stats = fill_groups(generate, num_groups=2, informative_only=informative_only)
    assert requested == [2, 1] and len(groups) == 2 and not any(group.failed for group in groups)
    assert (stats.groups_failed, stats.samples_failed, stats.failures) == (2, 3, ["E1", "E2"])
    metrics = stats.metrics(dynamic_sampling=informative_only)
    assert (metrics["rollout/failed_samples"], metrics["rollout/failed_groups"]) == (3, 2)
    assert ("rollout/generation_rounds" in metrics) == informative_only
    if informative_only:  # the failed groups are not counted as uninformative ones
        assert metrics["rollout/dropped_groups"] == 0 and metrics["rollout/informative_group_fraction"] == 1.0


def test_without_dynamic_sampling_equal_rewards_are_kept():
    groups, stats = fill_groups(lambda count: [make_group([1, 1])] * count, num_groups=2, informative_only=False)
    assert len(groups) == 2 and stats.rounds == 1 and stats.metrics(dynamic_sampling=False) == {
        "rollout/failed_samples": 0, "rollout/failed_groups": 0,
    }


def test_every_sample_failing_stops_at_once_naming_the_first_reason_and_the_fix():
    calls = []

    def generate(count):
        calls.append(count)
        return [failed_group("ValueError: too long", "E2")] * count

    with pytest.raises(AllSamplesFailed, match=r"refused every one of the 4 samples of this step; first: "
                                               r"ValueError: too long; .*--max-prompt-length"):
        fill_groups(generate, num_groups=2, informative_only=False)
    assert calls == [2]  # no second round


def test_failures_after_a_success_refill_until_the_round_limit():
    rounds = iter([[make_group([1, 1]), failed_group("E1")], [failed_group("E1")], [failed_group("E3")]])
    with pytest.raises(FillError) as info:
        fill_groups(lambda count: next(rounds), num_groups=2, max_rounds=3, informative_only=False)
    assert not isinstance(info.value, AllSamplesFailed)
    assert str(info.value).startswith(
        "kept 1 of 2 groups after 3 rounds: 3 samples in 3 groups failed in the engine (first reasons: E1 | E3); "
        "their groups were dropped; the engine refuses a request whose prompt"
    )


def test_overlong_penalty_matches_dapo():
    # max 20 tokens, the last 4 of them a soft buffer
    assert [overlong_penalty(n, 20, 4) for n in (10, 16, 17, 18, 20, 21)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="overlong buffer length 0"):
        overlong_penalty(5, 20, 0)
    group = make_group([1.0, 1.0])
    group.samples[1].response_token_ids = [5] * 18
    apply_overlong_penalty(group.samples, 20, 4, penalty_factor=1.0)
    assert group.rewards == [1.0, 0.5]


def test_overlong_penalty_factor_scales_the_penalty():
    # DAPO's reward manager: factor 0.5, at most 8 tokens, the last 4 a buffer: an 8-token response with reward
    # 1 exceeds the free 4 tokens by 4 of 4, so it loses 0.5; a 6-token one loses 0.25; beyond 8 still 0.5
    group = make_group([1.0, 1.0, 1.0, 1.0])
    for sample, length in zip(group.samples, (4, 6, 8, 9)):
        sample.response_token_ids = [5] * length
    apply_overlong_penalty(group.samples, 8, 4, penalty_factor=0.5)
    assert group.rewards == [1.0, 0.75, 0.5, 0.5]
