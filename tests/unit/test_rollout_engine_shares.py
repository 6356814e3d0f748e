"""How one generate call is spread over several engines (relax.rollout.rollout.split_over_engines and
completions_in_prompt_order, which relax.run.colocation.Colocation.generate runs over the Ray engine actors), with a
test double of the engine; the real engines: tests/e2e/test_loop_two_engines.py."""

import pytest

from relax.rollout.data import Prompt, PromptLoader
from relax.rollout.engine import Completion, SamplingConfig
from relax.rollout.rewards import load_reward_fn
from relax.rollout.rollout import (
    ROUND_SEED_STRIDE, completions_in_prompt_order, generate_and_score, generate_groups, most_requests_per_engine,
    split_over_engines,
)


class EngineDouble:
    """Numbers its requests from the call's seed like RolloutEngine.generate; each completion's tokens are
    (the prompt's first token, the request's seed), so where every completion came from can be read back."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append([prompt[0] for prompt in prompts])
        return [
            [Completion(token_ids=[prompt[0], sampling.seed + p * sampling.n + k], logprobs=[0.0, 0.0],
                        finish_reason="length", text=str(prompt[0]))
             for k in range(sampling.n)]
            for p, prompt in enumerate(prompts)
        ]


def generate_on(engines):
    """relax.run.colocation.Colocation.generate (no engine failing) with direct calls in place of Ray's."""

    def generate(prompts, sampling):
        shares = split_over_engines(prompts, sampling, len(engines))
        return completions_in_prompt_order(shares, [engines[s.engine].generate(s.prompts, s.sampling) for s in shares])

    return generate


@pytest.mark.parametrize("num_prompts", [0, 1, 2, 3, 5, 8])
def test_each_request_keeps_its_prompt_order_and_the_seed_one_engine_would_give_it(num_prompts):
    engines = [EngineDouble() for _ in range(3)]
    prompts = [[100 + i] for i in range(num_prompts)]
    sampling = SamplingConfig(n=2, seed=1000)
    completions = generate_on(engines)(prompts, sampling)
    one_engine = EngineDouble().generate(prompts, sampling)
    assert [[c.token_ids for c in g] for g in completions] == [[c.token_ids for c in g] for g in one_engine]
    assert [c.token_ids[1] for group in completions for c in group] == list(range(1000, 1000 + 2 * num_prompts))
    # Consecutive shares, sizes within one of each other; an engine without prompts is never called.
    calls = [engine.calls for engine in engines]
    assert [prompt for call in calls for prompt in (call[0] if call else [])] == [100 + i for i in range(num_prompts)]
    assert all(len(call) <= 1 and (not call or call[0]) for call in calls)
    sizes = [len(call[0]) if call else 0 for call in calls]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_shares_without_a_seed_stay_unseeded_and_a_single_engine_takes_the_whole_call():
    (share,) = split_over_engines([[1], [2], [3]], SamplingConfig(n=4), num_engines=1)
    assert share.engine == 0 and share.prompts == [[1], [2], [3]] and share.sampling.seed is None
    shares = split_over_engines([[1], [2], [3]], SamplingConfig(n=4), num_engines=2)
    assert [(s.engine, s.prompts, s.sampling.seed) for s in shares] == [(0, [[1], [2]], None), (1, [[3]], None)]


def test_the_samples_of_a_rollout_over_two_engines_come_scored_prompt_by_prompt():
    engines = [EngineDouble(), EngineDouble()]
    prompts = [Prompt(row=i, token_ids=[i], text=f"p{i}", label=str(i)) for i in range(3)]
    sampling = SamplingConfig(n=2, seed=0)
    samples = generate_and_score(generate_on(engines), prompts, sampling, load_reward_fn("exact_match"))
    assert [(s.prompt.row, s.response_token_ids) for s in samples] == [
        (0, [0, 0]), (0, [0, 1]), (1, [1, 2]), (1, [1, 3]), (2, [2, 4]), (2, [2, 5])
    ]
    assert [engine.calls for engine in engines] == [[[0, 1]], [[2]]]
    assert all(s.reward == 1.0 for s in samples)


def test_an_engine_that_loses_or_adds_completions_is_named():
    shares = split_over_engines([[1], [2], [3]], SamplingConfig(n=2, seed=0), num_engines=2)
    answers = [EngineDouble().generate(s.prompts, s.sampling) for s in shares]
    with pytest.raises(RuntimeError, match=r"engine 1 answered 0 prompts with \[\] completions for 1 prompts x 2"):
        completions_in_prompt_order(shares, [answers[0], []])
    with pytest.raises(RuntimeError, match=r"engine 0 answered 2 prompts with \[2, 1\] completions"):
        completions_in_prompt_order(shares, [[answers[0][0], answers[0][1][:1]], answers[1]])
    with pytest.raises(RuntimeError, match="2 engines were asked to generate, but 1 answered"):
        completions_in_prompt_order(shares, answers[:1])


def test_no_engines_is_an_error():
    with pytest.raises(ValueError, match="num_engines must be at least 1, got 0"):
        split_over_engines([[1]], SamplingConfig(), num_engines=0)


def test_dynamic_sampling_refuses_rounds_that_would_reuse_seeds():
    """A round's requests must fit in its seeds (ROUND_SEED_STRIDE), and the rounds in the step's."""
    loader = PromptLoader([Prompt(row=0, token_ids=[0], text="p", label="0")], shuffle=False)

    def never_called(prompts, sampling):
        raise AssertionError("generate was called")

    reward = load_reward_fn("exact_match")
    with pytest.raises(ValueError, match=r"4097 prompts x 16 samples .* lower --over-sampling-batch-size"):
        generate_groups(never_called, loader, SamplingConfig(n=16, seed=0), reward,
                                    num_groups=1, prompts_per_round=4097, max_rounds=10)
    with pytest.raises(ValueError, match=r"--dynamic-sampling-max-rounds 257 .* give at most 256"):
        generate_groups(never_called, loader, SamplingConfig(n=16, seed=0), reward,
                                    num_groups=1, prompts_per_round=4096, max_rounds=257)
    assert 4096 * 16 == ROUND_SEED_STRIDE  # the largest round that fits


@pytest.mark.parametrize("num_prompts, num_engines", [(64, 2), (5, 2), (3, 4), (128, 1), (10, 3)])
def test_most_requests_per_engine_is_the_largest_share_of_a_split(num_prompts, num_engines):
    """What relax sizes the engines' decode graphs by (relax.args.settings.rollout_requests_per_engine)."""
    shares = split_over_engines([[p] for p in range(num_prompts)], SamplingConfig(n=8), num_engines)
    assert most_requests_per_engine(num_prompts, 8, num_engines) == max(len(s.prompts) for s in shares) * 8
