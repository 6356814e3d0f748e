"""relax.rollout.evaluation against hand-computed values, with a scripted `generate` in place of the engines (the
real engines evaluate in tests/e2e/test_loop.py's run)."""

import pytest

from relax.rollout.data import Prompt
from relax.rollout.engine import Completion, SamplingConfig
from relax.rollout.evaluation import EvalSet, eval_due, eval_metrics, eval_seed, evaluate, pass_at_k, pass_ks
from relax.rollout.groups import Sample
from relax.rollout.rewards import load_reward_fn
from relax.rollout.tool_calls import ToolUse


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, 1 / 4),  # 1 - C(3,1)/C(4,1) = 1 - 3/4
        (4, 1, 2, 1 / 2),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 1, 4, 4 / 5),  # 1 - C(4,4)/C(5,4) = 1 - 1/5
        (8, 3, 2, 1 - 10 / 28),  # 1 - C(5,2)/C(8,2)
        (4, 0, 4, 0.0),
        (4, 3, 2, 1.0),  # n - c < k: every pair holds a passing sample
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 1, 5), (4, 5, 1), (4, 1, 0)):
        with pytest.raises(ValueError, match="need 1 <= k <= n"):
            pass_at_k(n, c, k)


def test_pass_ks_are_powers_of_two_up_to_k():
    assert pass_ks(1) == [1]
    assert pass_ks(4) == [1, 2, 4]
    assert pass_ks(6) == [1, 2, 4, 6]
    assert pass_ks(8) == [1, 2, 4, 8]


MULTI_TURN = {"turns_mean", "tool_calls", "tool_failures", "tool_timeouts", "masked_token_share"}


def _samples(prompt_rewards: dict[str, list[float]]) -> list[Sample]:
    samples = []
    for i, (label, rewards) in enumerate(prompt_rewards.items()):
        prompt = Prompt(row=i + 1, token_ids=[i], text=f"copy {label}:", label=label)
        for j, reward in enumerate(rewards):
            length = 1 + j % 2  # 1, 2, 1, 2 tokens
            samples.append(
                Sample(prompt, [0] * length, [0.0] * length, "length" if length == 2 else "stop", reward=reward)
            )
    return samples


def test_eval_metrics_by_hand():
    # prompt a: 1 of 4 passes (0.5 is partial credit, not a pass); prompt b: 2 of 4
    metrics = eval_metrics("held_out", _samples({"a": [1.0, 0.0, 0.5, 0.0], "b": [1.0, 1.0, 0.0, 0.0]}), 4)
    assert metrics == pytest.approx({
        "eval/held_out/reward_mean": 3.5 / 8,
        "eval/held_out/pass@1": (1 / 4 + 2 / 4) / 2,
        "eval/held_out/pass@2": (1 / 2 + 5 / 6) / 2,
        "eval/held_out/pass@4": 1.0,
        "eval/held_out/response_length_mean": 1.5,
        "eval/held_out/truncated_fraction": 0.5,
        "eval/held_out/reward_failures": 0.0,
        "eval/held_out/reward_timeouts": 0.0,
        "eval/held_out/failed_samples": 0.0,
        "eval/held_out/failed_prompts": 0.0,
    })


def test_an_evaluation_of_multi_turn_samples_counts_their_turns_and_tool_calls():
    samples = _samples({"a": [1.0, 0.0]})
    for sample, calls in zip(samples, (1, 2)):
        sample.tool_use = ToolUse(turns=calls + 1, tool_calls=calls, tool_failures=calls - 1)
        sample.loss_mask = [1] + [0] * (len(sample.response_token_ids) - 1)  # 1 and 2 tokens: 1 of 3 masked
    metrics = eval_metrics("tools", samples, 2)
    assert {k: v for k, v in metrics.items() if k.split("/")[-1] in MULTI_TURN} == pytest.approx({
        "eval/tools/turns_mean": 2.5, "eval/tools/tool_calls": 3.0, "eval/tools/tool_failures": 1.0,
        "eval/tools/tool_timeouts": 0.0, "eval/tools/masked_token_share": 1 / 3,
    })
    assert not MULTI_TURN & {k.split("/")[-1] for k in eval_metrics("plain", _samples({"a": [1.0, 0.0]}), 2)}


def test_a_prompt_with_a_failed_sample_is_counted_and_left_out_of_the_eval_metrics():
    samples = _samples({"a": [1.0, 0.0], "b": [0.0, 0.0]})
    samples[3].failure = "ValueError: too long"  # prompt b's second sample: the engine refused it
    metrics = eval_metrics("held_out", samples, 2)
    assert (metrics["eval/held_out/failed_samples"], metrics["eval/held_out/failed_prompts"]) == (1.0, 1.0)
    assert metrics["eval/held_out/reward_mean"] == 0.5 and metrics["eval/held_out/pass@2"] == 1.0  # prompt a's only
    for sample in samples:
        sample.failure = "ValueError: too long"
    assert eval_metrics("held_out", samples, 2) == {  # nothing to score: the counts alone, no reward of 0
        "eval/held_out/failed_samples": 4.0, "eval/held_out/failed_prompts": 2.0,
    }


def test_evaluate_reports_the_engine_refusing_samples_and_goes_on(capsys):
    def generate(prompts, sampling):  # refuses prompt [9]
        return [
            [Completion.refused("ValueError: too long") if p.token_ids[0] == 9
             else Completion([7], [0.0], "stop", str(p.token_ids[0]))]
            * sampling.n
            for p in prompts
        ]

    sets = [EvalSet("mixed", [Prompt(1, [0], "copy 0:", label="0"), Prompt(2, [9], "copy 9:", label="9")])]
    metrics = evaluate(generate, sets, SamplingConfig(n=2), load_reward_fn("exact_match"), seed=3)
    assert metrics["eval/mixed/failed_samples"] == 2 and metrics["eval/mixed/failed_prompts"] == 1
    assert metrics["eval/mixed/reward_mean"] == 1.0
    assert ("evaluation 'mixed': the engine refused 2 of 4 samples; their prompts are left out of its metrics "
            "(eval/mixed/failed_prompts); first reasons: ValueError: too long") in capsys.readouterr().err


def test_an_evaluation_counts_each_sample_a_custom_generate_function_fanned_out_as_one_of_its_prompts():
    def generate(prompts, sampling):  # K = 2 calls per prompt; prompt [1]'s first call fans out into 3 samples
        right, wrong = Completion([7], [0.0], "stop", "1"), Completion([7], [0.0], "stop", "0")
        return [[right, wrong, wrong, wrong] if p.token_ids[0] == 1 else [wrong, wrong] for p in prompts]

    sets = [EvalSet("fanned", [Prompt(1, [1], "copy 1:", label="1"), Prompt(2, [2], "copy 2:", label="1")])]
    metrics = evaluate(generate, sets, SamplingConfig(n=2), load_reward_fn("exact_match"), seed=3)
    assert metrics["eval/fanned/reward_mean"] == 1 / 6  # 1 right of the 6 samples
    assert metrics["eval/fanned/pass@1"] == pytest.approx((1 / 4 + 0) / 2)  # k of prompt [1]'s 4 samples
    assert metrics["eval/fanned/pass@2"] == pytest.approx((1 - 3 / 6 + 0) / 2)  # 1 - C(3,2)/C(4,2)
    assert metrics["eval/fanned/failed_prompts"] == 0


def test_eval_is_due_at_the_start_every_interval_and_after_the_last_step():
    assert [s for s in range(8) if eval_due(s, 7, 3)] == [0, 3, 6, 7]
    assert [s for s in range(7) if eval_due(s, 6, 3)] == [0, 3, 6]
    assert [s for s in range(6) if eval_due(s, 5, None)] == [0, 5]


def test_evaluate_samples_each_set_with_its_own_seeds_every_time():
    calls = []

    def generate(prompts, sampling):  # answers every prompt with its own digit then the digit 1
        calls.append((prompts, sampling.seed, sampling.n))
        return [
            [Completion([7], [0.0], "stop", str(p.token_ids[0])), Completion([7, 7], [0.0, 0.0], "length", "1")]
            for p in prompts
        ]

    sets = [
        EvalSet("zeros", [Prompt(1, [0], "copy 0:", label="0")]),
        EvalSet("ones", [Prompt(1, [1], "copy 1:", label="1"), Prompt(2, [0], "copy 0:", label="0")]),
    ]
    sampling = SamplingConfig(n=2, max_new_tokens=2)
    first = evaluate(generate, sets, sampling, load_reward_fn("exact_match"), seed=3)
    again = evaluate(generate, sets, sampling, load_reward_fn("exact_match"), seed=3)
    assert first == again
    assert first["eval/zeros/pass@1"] == 0.5 and first["eval/zeros/pass@2"] == 1.0
    assert first["eval/ones/pass@1"] == 0.75 and first["eval/ones/reward_mean"] == 0.75
    assert first["eval/ones/truncated_fraction"] == 0.5 and first["eval/ones/response_length_mean"] == 1.5
    assert [seed for _, seed, _ in calls] == [eval_seed(3, "zeros"), eval_seed(3, "ones")] * 2
    assert eval_seed(3, "zeros") != eval_seed(3, "ones") != eval_seed(4, "ones")
