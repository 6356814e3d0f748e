import pytest

from relax.rollout.data import Prompt
from relax.rollout.groups import (
    Group, Sample, apply_overlong_penalty, group_by_prompt, group_sizes, overlong_penalty,
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


def test_groups_fanned_out_by_a_custom_generate_function_are_as_large_as_their_samples_say():
    a, b = Prompt(1, [1], "a"), Prompt(2, [2], "b")
    samples = [Sample(a, [3], [0.0], "stop", group_size=3) for _ in range(3)] + [Sample(b, [3], [0.0], "stop")] * 2
    assert group_sizes(samples, 2) == [3, 2]
    assert [len(g.samples) for g in group_by_prompt(samples, 2)] == [3, 2]
    with pytest.raises(ValueError, match="4 samples do not split into groups of 2/3"):
        group_sizes(samples[1:], 2)
    with pytest.raises(ValueError, match="samples 0..2 do not share one prompt and one group size"):
        group_sizes(samples[:2] + samples[3:] + samples[3:4], 2)  # a, a, b | b, b


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
