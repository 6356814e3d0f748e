"""Reward functions: built-ins and user functions named `module:function` (--reward-fn).

A reward function is per sample or per batch, and its first parameter's name says which:

    def my_reward(sample: RewardInput) -> float                     # per sample
    def my_reward(samples: list[RewardInput]) -> list[float]        # per batch (one score per sample)

Either may be `async def`; per-sample async functions run concurrently. An exception (or a score that
is not a finite number) fails only the samples it concerns: they score `failure_score`, are counted and
the first few errors are kept for the report. Training goes on.

Built-ins (pass the short name): `math` (DAPO-Math style boxed answers, math-verify equivalence),
`exact_match`, and the synthetic tasks of relax.rollout.synthetic (`copy_digit`, `reverse3`).
"""

import asyncio
import importlib
import inspect
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

MAX_REPORTED_FAILURES = 10


@dataclass
class RewardInput:
    prompt: str
    response: str
    label: Any = None
    metadata: dict = field(default_factory=dict)
    finish_reason: str = "stop"


@dataclass
class RewardReport:
    samples: int = 0
    failures: int = 0
    errors: list[str] = field(default_factory=list)  # the first MAX_REPORTED_FAILURES

    def add_failure(self, what: str):
        self.failures += 1
        if len(self.errors) < MAX_REPORTED_FAILURES:
            self.errors.append(what)


# --- built-ins ---------------------------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) in text, braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    open_brace = text.index("{", start)
    depth = 0
    for i in range(open_brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1 : i]
    return None


_ANSWER_LINE = re.compile(r"Answer\s*:\s*(.+)", re.IGNORECASE)


def extract_math_answer(response: str) -> str | None:
    """The final answer of a math response: the last \\boxed{...}, else the last `Answer: ...` line (the
    form DAPO-Math-17k's prompt asks for)."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    matches = _ANSWER_LINE.findall(response)
    return matches[-1].strip().rstrip(".").strip("$ ") if matches else None


def math_reward(sample: RewardInput) -> float:
    """1.0 if the response's final answer equals the label mathematically (math-verify), else 0.0."""
    from math_verify import parse, verify

    answer = extract_math_answer(sample.response)
    if answer is None:
        return 0.0
    gold = str(sample.label)
    # math-verify finds an expression in LaTeX; wrap bare answers so both sides parse the same way.
    gold_parsed = parse(gold if "\\boxed" in gold or "$" in gold else f"${gold}$")
    answer_parsed = parse(f"${answer}$")
    return 1.0 if verify(gold_parsed, answer_parsed) else 0.0


def exact_match_reward(sample: RewardInput) -> float:
    """1.0 if the response equals the label after stripping surrounding whitespace, else 0.0."""
    return 1.0 if sample.response.strip() == str(sample.label).strip() else 0.0


def _builtins() -> dict[str, Callable]:
    from relax.rollout import synthetic

    return {
        "math": math_reward,
        "exact_match": exact_match_reward,
        **{name: task.reward for name, task in synthetic.TASKS.items()},
    }


# --- loading and calling -----------------------------------------------------------------------------

@dataclass
class RewardFn:
    fn: Callable
    name: str
    per_batch: bool
    is_async: bool


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name (`math`) or `module:function`, checked for the per-sample / per-batch signature."""
    builtins = _builtins()
    if spec in builtins:
        fn = builtins[spec]
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"--reward-fn {spec}: cannot import module {module_name!r}: {e}") from e
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"--reward-fn {spec}: module {module_name!r} has no function {attr!r}")
    else:
        raise ValueError(
            f"--reward-fn {spec!r}: not a built-in ({', '.join(sorted(builtins))}) and not module:function"
        )
    params = list(inspect.signature(fn).parameters)
    if not params or params[0] not in ("sample", "samples"):
        raise ValueError(
            f"--reward-fn {spec}: the first parameter must be named `sample` (per-sample function, returns a float) "
            f"or `samples` (per-batch function, returns a list of floats); got {params}"
        )
    return RewardFn(
        fn=fn, name=spec, per_batch=params[0] == "samples", is_async=inspect.iscoroutinefunction(fn)
    )


def _checked_score(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{what} returned {value!r}; a reward must be a finite number")
    return float(value)


async def _score_one(reward_fn: RewardFn, sample: RewardInput):
    """A score, or the exception that replaced it."""
    try:
        value = await reward_fn.fn(sample) if reward_fn.is_async else reward_fn.fn(sample)
        return _checked_score(value, reward_fn.name)
    except Exception as e:  # a reward function's bug must fail its sample, not the run
        return e


async def _score_batch(reward_fn: RewardFn, samples: list[RewardInput]):
    try:
        values = await reward_fn.fn(samples) if reward_fn.is_async else reward_fn.fn(samples)
        if len(values) != len(samples):
            raise ValueError(f"{reward_fn.name} returned {len(values)} scores for {len(samples)} samples")
        return [_checked_score(value, reward_fn.name) for value in values]
    except Exception as e:  # the whole batch fails together: there is no per-sample result to keep
        return [e] * len(samples)


async def async_score(
    reward_fn: RewardFn, samples: list[RewardInput], failure_score: float = 0.0
) -> tuple[list[float], list[bool], RewardReport]:
    """Scores for samples, which of them failed, and the report of failures."""
    if reward_fn.per_batch:
        results = await _score_batch(reward_fn, samples)
    elif reward_fn.is_async:
        results = await asyncio.gather(*(_score_one(reward_fn, sample) for sample in samples))
    else:
        # Sync functions run one after another in this thread: math-verify's timeouts use signal.alarm,
        # which only works in the main thread.
        results = [await _score_one(reward_fn, sample) for sample in samples]
    report = RewardReport(samples=len(samples))
    scores, failed = [], []
    for i, result in enumerate(results):
        if isinstance(result, Exception):
            report.add_failure(f"sample {i}: {type(result).__name__}: {result}")
            scores.append(failure_score)
            failed.append(True)
        else:
            scores.append(result)
            failed.append(False)
    return scores, failed, report


def score(reward_fn: RewardFn, samples: list[RewardInput], failure_score: float = 0.0):
    """async_score for callers outside an event loop. Uses a private loop and leaves the thread's current
    loop alone (an in-process SGLang engine keeps using its own)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(async_score(reward_fn, samples, failure_score))
    finally:
        loop.close()
