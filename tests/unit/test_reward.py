import json
import math
import sys
import time

import psutil
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


HANGING_REWARDS = """
import asyncio, os, time

def per_sample(sample):
    if sample.response == "hang":
        time.sleep(3600)  # a call that never returns
    if sample.response == "exit":
        os._exit(3)  # a call that takes its process with it
    return float(len(sample.response))

def per_batch(samples):
    if any(s.response == "hang" for s in samples):
        time.sleep(3600)
    return [1.0] * len(samples)

async def per_sample_async(sample):
    if sample.response == "hang":
        await asyncio.sleep(3600)
    if sample.response == "late":
        raise TimeoutError("the judge's own timeout")  # the function's failure, not relax's timeout
    return 2.0
"""


def spawned_processes() -> set[int]:
    """This process's multiprocessing-spawned children (not the resource tracker, which ends with this process)."""
    return {child.pid for child in psutil.Process().children() if "spawn_main" in " ".join(child.cmdline())}


def test_a_call_past_the_timeout_fails_alone_and_leaves_no_process(tmp_path, monkeypatch):
    (tmp_path / "hanging_rewards.py").write_text(HANGING_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))  # worker processes are spawned with this sys.path
    assert not spawned_processes()

    fn = load_reward_fn("hanging_rewards:per_sample", timeout=1.0)
    start = time.monotonic()
    scores, failed, report = score(fn, inputs(("a", None), ("hang", None), ("abc", None), ("exit", None), ("ab", None)))
    assert time.monotonic() - start < 10  # bounded: the stuck call is killed after 1 s, not waited for
    assert scores == [1.0, 0.0, 3.0, 0.0, 2.0] and failed == [False, True, False, True, False]
    assert report.timed_out == [1] and report.failures == 2
    assert "sample 1: timed out: no score within 1 s" in report.errors
    assert any(error.startswith("sample 3: the reward worker process died (exit code 3)") for error in report.errors)
    assert score(fn, inputs(("abcd", None), ("abcde", None)))[0] == [4.0, 5.0]  # the replacements score
    assert spawned_processes() == {worker.process.pid for worker in fn.workers.idle}  # the killed ones are gone
    fn.close()
    assert not spawned_processes()

    # a per-batch function: the batch is one call, and its samples fail together
    fn = load_reward_fn("hanging_rewards:per_batch", timeout=1.0)
    scores, failed, report = score(fn, inputs(("a", None), ("hang", None)))
    assert scores == [0.0, 0.0] and failed == [True, True] and report.timed_out == [0, 1]
    assert score(fn, inputs(("a", None), ("b", None)))[0] == [1.0, 1.0]
    fn.close()
    assert not spawned_processes()

    # an async function stays in this process, each call under the timeout
    fn = load_reward_fn("hanging_rewards:per_sample_async", timeout=1.0)
    scores, failed, report = score(fn, inputs(("a", None), ("hang", None), ("late", None)))
    assert scores == [2.0, 0.0, 0.0] and report.timed_out == [1] and fn.workers is None
    assert "sample 2: TimeoutError: the judge's own timeout" in report.errors
    sys.modules.pop("hanging_rewards", None)


def test_a_reward_worker_that_cannot_load_the_function_fails_naming_it(tmp_path, monkeypatch):
    (tmp_path / "loads_here_only.py").write_text("def reward(sample):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn("loads_here_only:reward", timeout=1.0)
    (tmp_path / "loads_here_only.py").write_text("raise ImportError('gone')\n")  # the workers import it afresh
    with pytest.raises(RuntimeError, match="--reward-fn loads_here_only:reward: a reward worker process could not"):
        score(fn, inputs(("a", None)))
    assert not spawned_processes()
    sys.modules.pop("loads_here_only", None)
