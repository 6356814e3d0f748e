"""Generation over the engine actors that survives an engine's death: the engine is started again in place.

An engine that dies during a rollout (its actor, or its SGLang scheduler or detokenizer: the liveness watch,
relax.ray.watch, reports any of them) or does not answer its share within --rollout-timeout is killed and started
again on the same bundle (the same devices, environment and init args: it loads --hf-checkpoint, as at the run's
start). Its siblings' shares are collected first; then, with an actor in the run, the normal device hand-over
and weight push (`refresh_weights`, the loop's) gives every engine the actor's current weights, so the new
engine is in its siblings' state; then the lost shares go to it again with their own seeds, and the call
returns what one uninterrupted call would have (under deterministic inference, the same tokens).

The memory order stays the colocated one: the new engine starts while the actor sleeps (the engines' turn),
and the weight push is the one every step ends with (engines' memory released, actor awake, push, actor asleep,
engines resumed). Before the actor's first push the push is redundant but harmless: the actor then holds the
--hf-checkpoint weights the new engine loaded.

At most `max_restarts` restarts per run; the next failure fails the run as before, naming the engine and its log.
An error the engine actor raised while alive (is_engine_death: not EngineDeadError) is not restarted: it fails the
run at once, naming the engine and the error, since a restarted engine would meet the same bug or input. (A
request SGLang refuses is no such error: RolloutEngine.generate returns it as a failed Completion.)

    generate = EngineRestarts(engines, max_restarts=3, start_timeout=..., rollout_timeout=..., refresh_weights=...)
    completions = generate(prompts, sampling)      # a relax.rollout.rollout.Generate
    restarts_this_step = generate.take_count()
"""

from typing import Callable

import ray

from relax.console import say
from relax.ray.placement import ActorGroup, WorkerFailed, wait_for, worker_failure
from relax.ray.watch import Timeout
from relax.rollout.engine import Completion, EngineDeadError, SamplingConfig
from relax.rollout.rollout import EngineShare, completions_in_prompt_order, split_over_engines


class EngineRestarts:
    def __init__(self, engines: ActorGroup, max_restarts: int, start_timeout: Timeout, rollout_timeout: Timeout,
                 refresh_weights: Callable[[], None] | None):
        self.engines = engines
        self.max_restarts = max_restarts
        self.start_timeout = start_timeout
        self.rollout_timeout = rollout_timeout
        self.refresh_weights = refresh_weights  # None without an actor: the engines keep --hf-checkpoint
        self.used = 0  # restarts over the run
        self._untaken = 0  # restarts since take_count()

    def __call__(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """Consecutive shares of the prompts, one per engine that gets any, each request seeded as one engine
        would seed it (split_over_engines); completions in prompt order. A share whose engine fails is sent
        again, once the engine is restarted and has the actor's weights."""
        shares = split_over_engines(prompts, sampling, len(self.engines))
        answers: list = [None] * len(shares)
        while unanswered := [k for k, answer in enumerate(answers) if answer is None]:
            restarted = self._collect(shares, unanswered, answers)
            if restarted:
                self._bring_up(restarted)
        return completions_in_prompt_order(shares, answers)

    def take_count(self) -> int:
        """The restarts since the last take_count() (a step's, for its metrics)."""
        count, self._untaken = self._untaken, 0
        return count

    def _collect(self, shares: list[EngineShare], to_send: list[int], answers: list) -> set[int]:
        """Send shares `to_send` and fill in their answers; returns the engines restarted meanwhile, whose
        shares stay unanswered."""
        calls = {
            k: self.engines.actors[shares[k].engine].generate.remote(shares[k].prompts, shares[k].sampling)
            for k in to_send
        }
        restarted = set()
        while calls:
            k = next(iter(calls))
            engine = shares[k].engine
            try:
                (answers[k],) = wait_for(
                    [calls[k]], self.engines.placement, self.rollout_timeout, [(self.engines, engine)]
                )
                del calls[k]
            except (ray.exceptions.RayError, WorkerFailed) as error:  # this engine's or another one's
                failed = self._restart(error)
                restarted.add(failed)
                calls = {j: ref for j, ref in calls.items() if shares[j].engine != failed}
        return restarted

    def _restart(self, error: Exception) -> int:
        """Restart the engine `error` names and return its index; raise the failure when it is not an engine's
        or the restarts are used up."""
        failure = error if isinstance(error, WorkerFailed) else worker_failure(error, [self.engines])
        if not isinstance(failure, WorkerFailed) or failure.group is not self.engines:
            raise failure from (None if failure is error else error)
        if not is_engine_death(error):  # a RuntimeError, not WorkerFailed: a run restart would not help either
            raise RuntimeError(
                f"{failure}; the engine is alive, so restarting it would not help: a bug, or bad input"
            ) from error
        if self.used >= self.max_restarts:
            raise WorkerFailed(
                f"{failure} (no engine restart left: --max-engine-restarts {self.max_restarts})",
                failure.group, failure.index,
            ) from error
        self.used += 1
        self._untaken += 1
        say(
            f"relax: {failure}; starting it again on its devices (engine restart {self.used} of at most "
            f"{self.max_restarts}, --max-engine-restarts)", error=True,
        )
        self.engines.restart(failure.index)
        return failure.index

    def _bring_up(self, restarted: set[int]) -> None:
        """Wait until the restarted engines have started, then give every engine the actor's weights."""
        indices = sorted(restarted)
        wait_for(
            [self.engines.actors[index].watched_child_pids.remote() for index in indices], self.engines.placement,
            self.start_timeout, [(self.engines, index) for index in indices],
        )
        if self.refresh_weights is not None:
            self.refresh_weights()


def is_engine_death(error: Exception) -> bool:
    """Whether a failed engine call is the engine's death or hang, which a restart may cure: the liveness watch's or a
    timeout's WorkerFailed, the actor's death, or EngineDeadError (its SGLang processes are gone) raised in the actor.
    Another error the actor raised (a RayTaskError with another cause) comes from a live engine."""
    if isinstance(error, ray.exceptions.RayTaskError):
        return isinstance(error.cause, (EngineDeadError, ray.exceptions.RayError))
    return True
