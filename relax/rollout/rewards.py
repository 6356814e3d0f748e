"""Reward functions: built-ins and user functions named `module:function` (--reward-fn).

A reward function is per sample or per batch, and its first parameter's name says which:

    def my_reward(sample: RewardInput) -> float                     # per sample
    def my_reward(samples: list[RewardInput]) -> list[float]        # per batch (one score per sample)

Either may be `async def`; per-sample async functions run concurrently. An exception (or a score that
is not a finite number) fails only the samples it concerns: they score `failure_score`, are counted and
the first few errors are kept for the report. Training goes on.

With a timeout (--reward-timeout), each call of the function (one sample's, or the batch's) that does not
return in time fails the same way, and is counted as a timeout too. A sync function then runs in
RewardWorkers, processes of its own: a call that never returns is ended by killing its process, which a new
one replaces. An async function runs in the driver's event loop, each call cancelled at the timeout, so its
calls stay concurrent; what it awaits is bounded, a blocking call inside it is not.

Built-ins (pass the short name): `math` (DAPO-Math style boxed answers, math-verify equivalence),
`exact_match`, and the synthetic tasks of relax.rollout.synthetic (`copy_digit`, `reverse3`, `multiply`).
"""

import asyncio
import inspect
import math
import multiprocessing
import os
import re
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_connections
from typing import Any, Callable

from relax.rollout.user_functions import import_user_function

MAX_REPORTED_FAILURES = 10
MAX_REWARD_WORKERS = 8  # processes calling a sync function under a timeout (fewer where fewer cores are ours)
WORKER_START_TIMEOUT_S = 300  # a worker imports the reward function's module (and what it imports) first


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
    failures: int = 0  # timeouts included
    errors: list[str] = field(default_factory=list)  # the first MAX_REPORTED_FAILURES
    timed_out: list[int] = field(default_factory=list)  # the samples whose call did not return in time

    def add_failure(self, what: str):
        self.failures += 1
        if len(self.errors) < MAX_REPORTED_FAILURES:
            self.errors.append(what)

    def add(self, other: "RewardReport") -> None:
        """Count `other`'s samples after these (its timed-out sample indices shifted past them)."""
        self.timed_out += [self.samples + index for index in other.timed_out]
        self.samples += other.samples
        self.failures += other.failures
        self.errors = (self.errors + other.errors)[:MAX_REPORTED_FAILURES]


@dataclass(frozen=True)
class Failure:
    """Why a call of the reward function gave no score."""

    reason: str
    timed_out: bool = False


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
    name: str  # the --reward-fn spec: what a worker process loads
    per_batch: bool
    is_async: bool
    timeout: float | None = None  # seconds per call; None: unbounded, sync calls in the driver's thread
    workers: "RewardWorkers | None" = None  # for a sync function under a timeout: started at its first call

    def close(self):
        """End the worker processes, if any were started."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None


def load_reward_fn(spec: str, timeout: float | None = None) -> RewardFn:
    """A built-in name (`math`) or `module:function`, checked for the per-sample / per-batch signature."""
    builtins = _builtins()
    if spec in builtins:
        fn = builtins[spec]
    elif ":" in spec:
        fn = import_user_function(spec, "--reward-fn")
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
        fn=fn, name=spec, per_batch=params[0] == "samples", is_async=inspect.iscoroutinefunction(fn), timeout=timeout
    )


def _checked_score(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{what} returned {value!r}; a reward must be a finite number")
    return float(value)


def _checked(reward_fn: RewardFn, value, payload):
    """A per-sample call's score, or a per-batch call's scores (one per sample of the payload)."""
    if not reward_fn.per_batch:
        return _checked_score(value, reward_fn.name)
    if len(value) != len(payload):
        raise ValueError(f"{reward_fn.name} returned {len(value)} scores for {len(payload)} samples")
    return [_checked_score(v, reward_fn.name) for v in value]


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _call_sync(reward_fn: RewardFn, payload):
    """One call of a sync function (a sample, or the batch's samples): its checked result, or the Failure."""
    try:
        return _checked(reward_fn, reward_fn.fn(payload), payload)
    except Exception as e:  # a reward function's bug must fail its samples, not the run
        return Failure(_describe(e))


async def _call_async(reward_fn: RewardFn, payload):
    """One call of an async function, bounded by the timeout: its checked result, or the Failure."""
    task = asyncio.ensure_future(reward_fn.fn(payload))
    try:
        # asyncio.wait, not wait_for: a TimeoutError the function raises itself is a failure, not a timeout
        done, _ = await asyncio.wait([task], timeout=reward_fn.timeout)
        if not done:
            task.cancel()
            return Failure(f"timed out: no score within {reward_fn.timeout:g} s", timed_out=True)
        return _checked(reward_fn, task.result(), payload)
    except Exception as e:
        return Failure(_describe(e))


async def async_score(
    reward_fn: RewardFn, samples: list[RewardInput], failure_score: float = 0.0
) -> tuple[list[float], list[bool], RewardReport]:
    """Scores for samples, which of them failed, and the report of failures."""
    payloads = [samples] if reward_fn.per_batch else samples  # what each call of the function takes
    if reward_fn.is_async:
        results = await asyncio.gather(*(_call_async(reward_fn, payload) for payload in payloads))
    elif reward_fn.timeout is not None:
        if reward_fn.workers is None:
            reward_fn.workers = RewardWorkers(reward_fn.name, reward_fn.timeout)
        results = reward_fn.workers.call_each(payloads)
    else:
        # Sync functions run one after another in this thread: math-verify's timeouts use signal.alarm,
        # which only works in the main thread.
        results = [_call_sync(reward_fn, payload) for payload in payloads]
    if reward_fn.per_batch:  # the whole batch fails together: there is no per-sample result to keep
        results = results[0] if isinstance(results[0], list) else results * len(samples)
    report = RewardReport(samples=len(samples))
    scores, failed = [], []
    for i, result in enumerate(results):
        if isinstance(result, Failure):
            report.add_failure(f"sample {i}: {result.reason}")
            if result.timed_out:
                report.timed_out.append(i)
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


# --- worker processes (sync functions under a timeout) -------------------------------------------------

def _worker_main(spec: str, connection):
    """A reward worker process: load the function, say so, then answer each payload received with
    _call_sync's result, until the driver closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; the driver decides the end
    try:
        reward_fn = load_reward_fn(spec)
    except Exception as e:
        connection.send(Failure(_describe(e)))
        return
    connection.send("ready")
    while True:
        try:
            payload = connection.recv()
        except EOFError:  # the driver closed the pipe, or died: nothing more to score
            return
        connection.send(_call_sync(reward_fn, payload))


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    connection: Any  # multiprocessing.connection.Connection, the driver's end of the pipe

    def wait_until_loaded(self, spec: str):
        problem = None
        if not self.connection.poll(WORKER_START_TIMEOUT_S):
            problem = f"did not load it within {WORKER_START_TIMEOUT_S} s"
        else:
            try:
                message = self.connection.recv()
                if isinstance(message, Failure):
                    problem = f"could not load it: {message.reason}"
            except EOFError:
                problem = f"died while loading it (exit code {self.stop()})"
        if problem:
            raise RuntimeError(f"--reward-fn {spec}: a reward worker process {problem}")

    def stop(self) -> int | None:
        """Kill the process (idle, stuck or already gone: there is nothing of it to keep) and return its exit code."""
        self.process.kill()
        self.process.join()
        self.connection.close()
        return self.process.exitcode


class RewardWorkers:
    """Processes that call one sync reward function (loaded by its spec), each call bounded by `timeout` seconds:
    a process whose call runs past it is killed, its payload fails as timed out, and a new process takes its place.
    Processes start when calls need them, up to MAX_REWARD_WORKERS (or as many cores as this process may use),
    and live until close()."""

    def __init__(self, spec: str, timeout: float):
        self.spec, self.timeout = spec, timeout
        self.max_workers = min(MAX_REWARD_WORKERS, len(os.sched_getaffinity(0)))
        self.idle: list[_Worker] = []

    def call_each(self, payloads: list) -> list:
        """One call per payload, spread over the processes: each one's result, or its Failure, in payload order."""
        results = [None] * len(payloads)
        waiting = list(enumerate(payloads))[::-1]  # pop() takes the next
        busy = {}  # the driver's end of a busy worker's pipe -> (worker, payload index, deadline)
        try:
            while waiting or busy:
                missing = min(len(waiting), self.max_workers - len(busy)) - len(self.idle)
                if missing > 0:
                    self.idle += self._start(missing)
                while waiting and self.idle:
                    worker, (index, payload) = self.idle.pop(), waiting.pop()
                    worker.connection.send(payload)
                    busy[worker.connection] = (worker, index, time.monotonic() + self.timeout)
                next_deadline = min(deadline for _, _, deadline in busy.values())
                for connection in wait_for_connections(list(busy), max(0.0, next_deadline - time.monotonic())):
                    worker, index, _ = busy.pop(connection)
                    try:
                        results[index] = connection.recv()
                        self.idle.append(worker)
                    except EOFError:  # the function ended its process (os._exit, a crash, the OOM killer)
                        results[index] = Failure(f"the reward worker process died (exit code {worker.stop()})")
                now = time.monotonic()
                for connection, (worker, index, deadline) in list(busy.items()):
                    if deadline <= now:
                        del busy[connection]
                        worker.stop()
                        results[index] = Failure(f"timed out: no score within {self.timeout:g} s", timed_out=True)
        finally:  # interrupted mid-call: a late answer must not pass for the next call's
            for worker, _, _ in busy.values():
                worker.stop()
        return results

    def _start(self, count: int) -> list[_Worker]:
        context = multiprocessing.get_context("spawn")  # fork is unsafe in a driver with threads (Ray's, ...)
        started = []
        try:
            for _ in range(count):
                ours, theirs = context.Pipe()
                process = context.Process(target=_worker_main, args=(self.spec, theirs), name="relax-reward-worker")
                process.start()
                started.append(_Worker(process, ours))
                theirs.close()  # the worker's end lives in the worker only: its death reads as EOF here
            for worker in started:  # loading in parallel; a call's time counts from here on
                worker.wait_until_loaded(self.spec)
        except BaseException:
            for worker in started:
                worker.stop()
            raise
        return started

    def close(self):
        for worker in self.idle:
            worker.stop()
        self.idle = []
