import json
import math
import sys

import pytest

from relax.rollout import rewards
from relax.rollout.rewards import RewardInput, extract_math_answer, load_reward_fn, score
from relax.rollout.synthetic import COPY_DIGITS, char_match_score, write_task


def inputs(*pairs):
    return [RewardInput(prompt="", response=response, label=label) for response, label in pairs]


@pytest.mark.parametrize(
    "response, label, expected",
    [
        (r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{3} first, then \boxed{x^{2}+1}", "1+x^2", 1.0),
        ("Some steps.\nAnswer: 34", "34", 1.0),
        (r"\boxed{35}", "34", 0.0),
        ("no final answer here", "34", 0.0),
    ],
)
def test_math_reward(response, label, expected):
    assert rewards.math_reward(RewardInput(prompt="", response=response, label=label)) == expected


def test_boxed_extraction_balances_braces():
    assert extract_math_answer(r"\boxed{\frac{a}{b}} tail") == r"\frac{a}{b}"
    assert extract_math_answer(r"\boxed{unclosed") is None


def test_exact_match_and_synthetic_builtins(tmp_path):
    scores, failed, _ = score(load_reward_fn("exact_match"), inputs((" 42\n", "42"), ("41", "42")))
    assert scores == [1.0, 0.0] and failed == [False, False]
    assert char_match_score("7", "7") == 1.0
    assert char_match_score("7ab", "7") == pytest.approx(1 / 3)
    assert char_match_score("cbx", "cba") == pytest.approx(2 / 3)
    assert char_match_score("", "7") == 0.0

    # shaped synthetic rewards: first character, agreement, length, alphabet
    copy_digit = load_reward_fn("copy_digit")
    assert score(copy_digit, inputs(("1", "1"), ("1000", "1"), ("0", "1"), ("x", "1"), ("", "1")))[0] == pytest.approx(
        [1.0, 0.5 + 0.3 / 4 + 0.1, 0.1 + 0.1, 0.1, 0.0]
    )
    path = write_task("reverse3", 20, tmp_path / "r.jsonl", seed=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 20 and all(row["label"] == row["prompt"][8:11][::-1] for row in rows)
    copy_rows = write_task("copy_digit", 50, tmp_path / "c.jsonl").read_text().splitlines()
    digits = [json.loads(line)["label"] for line in copy_rows]
    assert set(digits) == set(COPY_DIGITS)
    scores, _, _ = score(load_reward_fn("reverse3"), inputs(*((row["label"], row["label"]) for row in rows)))
    assert scores == [1.0] * 20


def test_user_functions_sync_async_sample_and_batch(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "import asyncio\n"
        "def per_sample(sample):\n    return float(len(sample.response))\n"
        "async def per_sample_async(sample):\n    await asyncio.sleep(0)\n    return 1.0\n"
        "def per_batch(samples):\n    return [float(i) for i, _ in enumerate(samples)]\n"
        "async def per_batch_async(samples):\n    return [2.0] * len(samples)\n"
        "def bad_signature(response, label):\n    return 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = inputs(("ab", None), ("abc", None))
    expected = {
        "per_sample": [2.0, 3.0],
        "per_sample_async": [1.0, 1.0],
        "per_batch": [0.0, 1.0],
        "per_batch_async": [2.0, 2.0],
    }
    for name, want in expected.items():
        fn = load_reward_fn(f"my_rewards:{name}")
        assert fn.per_batch == name.startswith("per_batch")
        assert fn.is_async == name.endswith("async")
        assert score(fn, samples)[0] == want
    with pytest.raises(ValueError, match="first parameter must be named `sample`"):
        load_reward_fn("my_rewards:bad_signature")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        load_reward_fn("my_rewards:missing")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        load_reward_fn("no_such_module:f")
    with pytest.raises(ValueError, match="not a built-in"):
        load_reward_fn("nonsense")
    sys.modules.pop("my_rewards", None)


def test_failures_are_counted_not_fatal():
    def flaky(sample):
        if sample.response == "boom":
            raise RuntimeError("kaput")
        if sample.response == "nan":
            return math.nan
        return 1.0

    fn = rewards.RewardFn(fn=flaky, name="flaky", per_batch=False, is_async=False)
    scores, failed, report = score(fn, inputs(("ok", 1), ("boom", 1), ("nan", 1), ("ok", 1)), failure_score=-1.0)
    assert scores == [1.0, -1.0, -1.0, 1.0]
    assert failed == [False, True, True, False]
    assert (report.samples, report.failures) == (4, 2)
    assert report.errors[0] == "sample 1: RuntimeError: kaput"
    assert "flaky returned nan" in report.errors[1]

    def broken_batch(samples):
        return [1.0]  # wrong length

    fn = rewards.RewardFn(fn=broken_batch, name="broken_batch", per_batch=True, is_async=False)
    scores, failed, report = score(fn, inputs(("a", 1), ("b", 1)))
    assert scores == [0.0, 0.0] and failed == [True, True] and report.failures == 2
    assert "returned 1 scores for 2 samples" in report.errors[0]
