"""The devices the training actor and the engines share, handed between them phase by phase, and the engines
restarted in place when one dies in any phase.

Each step hands the devices over twice: to the actor (the engines release their memory, the actor wakes) and back
to the engines (their weights resumed, the actor's pushed, the actor asleep, their KV cache resumed). In between
the engines generate: the rollout (Colocation is its relax.rollout.rollout.EnginePool: submit, next_done, abort) and
the evaluation (generate, through the same dispatch). Each prompt group is one call, sent whole (the engine's
prefix cache serves its shared prompt) to the engine with the fewest requests in flight, ties to the lowest index.
relax balances the engines itself: SGLang's router (sglang-router) is an HTTP proxy in front of SGLang HTTP
servers, while relax's engines are in-process sglang.Engine objects in Ray actors, with no HTTP server.

An engine holds nothing the run needs that the actor does not hold too, so an engine that dies (its actor, its
SGLang scheduler or detokenizer: EngineDeadError, a dead actor, the liveness watch of relax.ray.watch) or does not
answer in time is started again on its devices, whichever process met its death first (the driver, a training
rank's push, the evaluation):
- the actor is put to sleep while the new engine starts (the memory is the engines' at start), then woken
  again if it was awake;
- the new engine releases what the others have released, so it is in their state;
- the call it missed is made again: a memory call on it alone, a weight push to every engine (the survivors
  have closed theirs complete), the prompt groups it held with their own seeds;
- it loaded --hf-checkpoint: before any engine generates again, the groups in flight on the others complete and
  every engine gets the actor's weights (the step's own two hand-overs), unless a push comes first anyway; until
  then new groups wait with the dead engine's.
At most --max-engine-restarts over the run; past them, an engine's death fails the run, naming the engine and its
log, as does a failed restart. An error an engine raises while alive (a bug or a bad input) fails the run at once,
without a restart of the engine or of the run (--max-restarts): neither would help. Restarts and their seconds
are counted (faults/engine_restarts, faults/engine_restart_seconds).

While restarts are left, the actor's own calls (wake, train, save, sleep) watch only the training ranks: an
engine that dies while the actor trains is restarted at the next engine call, not while the actor holds the
devices.

With --no-colocate (relax.run.loop_async) nothing is handed over: the engines generate while the actor trains, and
Colocation dispatches their groups, restarts them and pushes the weights (push) as above, but a restarted engine
cannot get the weights the others generate with. Its groups and the new ones go to the engines not restarted since
the last push; once none is left, and no group runs, the loop's refresh_weights (beside_training) gives every engine
the actor's weights: the step's training waited for, then pushed, a step ahead of the rollout's (weights_ahead).
"""

import time
from collections.abc import Callable
from typing import NamedTuple

import ray

from relax.console import say
from relax.ray.faults import FaultPlan
from relax.ray.placement import ActorGroup, WorkerFailed, first_done, wait_for, worker_failure
from relax.ray.watch import Timeout
from relax.rollout.data import Prompt
from relax.rollout.engine import MEMORY_TAGS, Completion, EngineDeadError, SamplingConfig
from relax.rollout.partial import ResponseSoFar
from relax.rollout.rollout import offset_seed

KV_CACHE = ("kv_cache", "cuda_graph")  # what the engines resume after a push


class GroupCall(NamedTuple):
    """A prompt group submitted to the engines: its requests, and where and since when it runs."""

    @property
    def requests(self) -> int:
        return self.sampling.n if self.prefixes is None else len(self.prefixes)

    prompt: list[int]
    sampling: SamplingConfig
    prefixes: list[ResponseSoFar] | None  # the responses it continues (partial rollout), else sampling.n new ones
    source: Prompt | None = None  # the prompt's data row, for a custom generate function
    evaluation: bool = False  # an evaluation's group (the function is told)
    engine: int | None = None  # None: held back (waiting for a restarted engine's weights)
    ref: ray.ObjectRef | None = None
    deadline: float | None = None  # time.monotonic() past which it did not answer in time (--rollout-timeout)


class Colocation:
    def __init__(self, trainers: ActorGroup | None, engines: ActorGroup | None, devices_per_engine: int, settings,
                 faults: FaultPlan, engines_apart: bool = False):
        """`trainers` None: --debug-rollout-only and --eval-only (the engines keep --hf-checkpoint's weights);
        `engines` None: --debug-train-only. `settings`: relax.args.settings.RunSettings' max_engine_restarts,
        engine_start_timeout, rollout_timeout and weight_sync_timeout. The actor starts asleep and the engines with
        all their memory (relax.run.loop.start_workers). `engines_apart`: the engines are on devices of their own
        (--no-colocate with --rollout-num-devices N), which the weight push takes by broadcast."""
        self.trainers, self.engines = trainers, engines
        self.devices_per_engine = devices_per_engine
        self.engines_apart = engines_apart
        self.max_restarts: int = settings.max_engine_restarts
        self.start_timeout: Timeout = settings.engine_start_timeout
        self.rollout_timeout: Timeout = settings.rollout_timeout
        self.sync_timeout: Timeout = settings.weight_sync_timeout
        self.faults = faults
        self.actor_awake = False
        self.engine_memory = set(MEMORY_TAGS)  # what every engine holds on its devices now
        self.stale: set[int] = set()  # engines restarted since the last push: they hold --hf-checkpoint's weights
        self.used = 0  # restarts over the run
        self._groups: dict[int, GroupCall] = {}  # the groups submitted and not yet returned, by key
        self._aborted_groups: list[tuple[int, list[Completion]]] = []  # returned aborted without running
        self._seen_done: list[tuple[int, ray.ObjectRef]] = []  # running groups' calls seen done: _next_done_call
        self._aborting = False  # an abort is under way: its groups come back
        self._untaken, self._untaken_seconds = 0, 0.0
        # How every engine gets the actor's weights before a restarted one generates: colocated, the step's two
        # hand-overs, once no group runs; beside the training (beside_training), the loop's own.
        self._refresh_weights: Callable[[], None] = self._hand_over_weights
        self._beside_training = False
        # Steps the engines' weights are ahead of those the running rollout's step samples with by the loop's
        # schedule: 0, but 1 where relax.run.loop_async gave them the step's trained weights mid-rollout. The
        # rollout records its tokens' step so (relax.rollout.partial).
        self.weights_ahead = 0
        if trainers is not None and engines is not None and self.max_restarts > 0:
            trainers.watched = [trainers]

    # --- the hand-overs -----------------------------------------------------------------------------------

    def to_actor(self, inject_faults: bool = True) -> None:
        """The engines release their memory (there are none under --debug-train-only); the actor wakes.
        `inject_faults`: the tests' fault due at this phase (relax.ray.faults); not in generate's weight refresh."""
        if self.engines is not None:
            if inject_faults:
                self.faults.inject("release", self.engines, self.trainers)
            self._on_engines("release_memory_occupation", list(MEMORY_TAGS))
            self.engine_memory = set()
        self._actor("wake")

    def to_engines(self, inject_faults: bool = True) -> list[dict] | None:
        """Push the actor's weights (the engines' weights resumed, their KV cache not yet), put the actor to
        sleep, resume the engines' KV cache. Returns each rank's push report (TrainWorker.push_weights). Under
        --debug-train-only there are no engines: the actor only sleeps. `inject_faults`: as to_actor's."""
        if self.engines is None:
            self._actor("sleep")
            return None
        self._on_engines("resume_memory_occupation", ["weights"])
        self.engine_memory = {"weights"}
        reports = self._push(self.faults.victim_at("push", self.engines, self.trainers) if inject_faults else None)
        self._actor("sleep")
        if inject_faults:
            self.faults.inject("resume", self.engines, self.trainers)
        self._on_engines("resume_memory_occupation", list(KV_CACHE))
        self.engine_memory = set(MEMORY_TAGS)
        return reports

    def beside_training(self, refresh_weights: Callable[[], None]) -> None:
        """--no-colocate (relax.run.loop_async): the engines generate while the actor trains, with weights the
        actor no longer holds, which a restarted engine cannot get. Its groups go to the engines not restarted
        since the last push while one is left; once none is, and no group runs, `refresh_weights()` gives every
        engine the actor's weights (through push) before the held groups are sent."""
        self._refresh_weights, self._beside_training = refresh_weights, True

    def push(self, inject_faults: bool = True) -> list[dict]:
        """The actor's weights to every engine as they are (--no-colocate: nothing sleeps or was released);
        returns each rank's push report. `inject_faults`: as to_actor's."""
        return self._push(self.faults.victim_at("push", self.engines, self.trainers) if inject_faults else None)

    def _hand_over_weights(self) -> None:
        self.to_actor(inject_faults=False)
        self.to_engines(inject_faults=False)

    def _actor(self, method: str) -> None:
        self.trainers.run(method, timeout=self.sync_timeout)
        self.actor_awake = method == "wake"

    # --- generation: relax.rollout.rollout.EnginePool -----------------------------------------------------

    def submit(self, key: int, prompt: list[int], sampling: SamplingConfig,
               prefixes: list[ResponseSoFar] | None = None, source: Prompt | None = None,
               evaluation: bool = False) -> None:
        """Send a prompt group (or the continuations of its responses `prefixes`) to the engine with the fewest
        requests in flight (ties: the lowest index), or hold it back while a restarted engine waits for the
        actor's weights (beside the training: while none of the engines not restarted is left)."""
        hold = not self._current_engines() or any(call.ref is None for call in self._groups.values())
        self._groups[key] = GroupCall(prompt, sampling, prefixes, source, evaluation)
        if not hold:
            self._send(key)

    def next_done(self) -> tuple[int, list[Completion]]:
        """The next group to complete: its key and completions. A group whose engine dies is held back and sent
        again, with its seeds, once every engine has the actor's weights (the groups still running on the others
        complete first), or beside the training at once to an engine not restarted, where one is left; after an
        abort it comes back aborted instead."""
        done = self._aborted_groups.pop(0) if self._aborted_groups else self._next_completed()
        if not self._groups and not self._aborted_groups:
            self._aborting = False  # every group is back
        return done

    def _next_completed(self) -> tuple[int, list[Completion]]:
        while True:
            try:
                key, ref = self._next_done_call()
                completions = ray.get(ref)
            except (ray.exceptions.RayError, WorkerFailed) as error:  # this engine's or another one's
                self._restart(self._engine_death(error))  # its groups held back, or returned aborted
                if self._aborted_groups:
                    return self._aborted_groups.pop(0)
                if self._current_engines() and any(call.ref is None for call in self._groups.values()):
                    self._send_held()  # beside the training, to the engines not restarted
                continue
            del self._groups[key]
            return key, completions

    def _next_done_call(self) -> tuple[int, ray.ObjectRef]:
        """The key and call of a running group whose call is done (it may hold an error). One wait over the groups
        in flight finds every call done by then, and the next calls take those first: a wait per batch of groups
        completed, not per group (an abort returns every group in flight at once)."""
        while self._seen_done:
            key, ref = self._seen_done.pop(0)
            call = self._groups.get(key)
            if call is not None and call.ref is ref:  # not sent again since (an engine restart)
                return key, ref
        while True:
            calls = {call.ref: (key, call) for key, call in self._groups.items() if call.ref is not None}
            if calls:
                break
            self._send_held()
        running = [call for _, call in calls.values()]
        ref = first_done(list(calls), self.engines.placement, [call.deadline for call in running],
                         self.rollout_timeout, [(self.engines, call.engine) for call in running])
        others = [other for other in calls if other is not ref]
        done_too, _ = ray.wait(others, num_returns=len(others), timeout=0) if others else ([], [])
        self._seen_done = [(calls[other][0], other) for other in done_too]
        return calls[ref][0], ref

    def abort(self) -> None:
        """Every group in flight ends soon (SGLang's abort on every engine) and comes back through next_done; a
        held group comes back aborted at once, without running."""
        self._aborting = True
        for key in [key for key, call in self._groups.items() if call.ref is None]:
            self._return_aborted(key)
        self._on_engines("abort_requests")

    def _return_aborted(self, key: int) -> None:
        """Group `key` comes back aborted without running (next_done)."""
        call = self._groups.pop(key)
        self._aborted_groups.append((key, [Completion.aborted() for _ in range(call.requests)]))

    def generate(self, prompts: list[Prompt], sampling: SamplingConfig) -> list[list[Completion]]:
        """A relax.rollout.rollout.Generate over the engines (the evaluation's): each prompt one group, submitted
        as the rollout submits, prompt p's requests seeded from sampling.seed + p x n; completions in prompt
        order."""
        for p, prompt in enumerate(prompts):
            self.submit(p, prompt.token_ids, offset_seed(sampling, p * sampling.n), source=prompt, evaluation=True)
        answers = dict(self.next_done() for _ in prompts)
        return [answers[p] for p in range(len(prompts))]

    def _waiting_for_weights(self) -> bool:
        """Whether a restarted engine still holds --hf-checkpoint's weights where the actor has its own."""
        return bool(self.stale) and self.trainers is not None

    def _current_engines(self) -> list[int]:
        """The engines a group may go to now: every one, but while a restarted engine waits for the actor's
        weights, none colocated (every engine gets them first) and beside the training those not restarted (which
        keep the weights the others lack)."""
        if not self._waiting_for_weights():
            return list(range(len(self.engines)))
        return [index for index in range(len(self.engines)) if index not in self.stale] if self._beside_training else []

    def _send(self, key: int) -> None:
        call = self._groups[key]
        load = [0] * len(self.engines)
        for other in self._groups.values():
            if other.engine is not None:
                load[other.engine] += other.requests
        engine = min(self._current_engines(), key=lambda index: (load[index], index))
        deadline = None if self.rollout_timeout.seconds is None else time.monotonic() + self.rollout_timeout.seconds
        ref = self.engines.actors[engine].generate_group.remote(
            call.prompt, call.sampling, call.prefixes, call.source, call.evaluation
        )
        self._groups[key] = call._replace(engine=engine, ref=ref, deadline=deadline)

    def _send_held(self) -> None:
        """Send the held groups in key order; where no engine may take them (then nothing runs), every engine gets
        the actor's weights first."""
        if not self._current_engines():
            self._refresh_weights()
        held = sorted(key for key, call in self._groups.items() if call.ref is None)
        if not held:
            raise RuntimeError("waiting for a prompt group to complete, but none was submitted")
        for key in held:
            self._send(key)

    # --- engine calls and restarts ------------------------------------------------------------------------

    def _on_engines(self, method: str, *args) -> None:
        """`method` on every engine, waited on; an engine that dies meanwhile is restarted (in the state the
        engines had before the call) and called again."""
        calls = {index: getattr(actor, method).remote(*args) for index, actor in enumerate(self.engines.actors)}
        while calls:
            index, ref = next(iter(calls.items()))
            try:
                wait_for([ref], self.engines.placement, self.sync_timeout, [(self.engines, index)])
                del calls[index]
            except (ray.exceptions.RayError, WorkerFailed) as error:
                restarted = self._restart(self._engine_death(error))
                calls[restarted] = getattr(self.engines.actors[restarted], method).remote(*args)

    def _push(self, victim_pid: int | None) -> list[dict]:
        """The actor's weights to every engine (awake, the engines' weights resumed); a push that met a dead
        engine is made again once the engine is restarted. `victim_pid`: RELAX_INJECT_FAULTS' push victim,
        killed by training rank 0 once its first bucket is sent."""
        engine_nodes = [bundle.node_id for bundle in self.engines.bundles]
        while True:
            refs = self.trainers.call(
                "push_weights", self.engines.actors, self.devices_per_engine, engine_nodes, victim_pid,
                engines_apart=self.engines_apart,
            )
            victim_pid = None
            try:
                reports = self.trainers.wait(refs, self.sync_timeout)
                self.stale.clear()
                return reports
            except (ray.exceptions.RayError, WorkerFailed) as error:
                failure = self._engine_death(error)
                # Every rank finishes its push (the buckets are collective) before the actor may sleep.
                ray.wait(refs, num_returns=len(refs), timeout=self.sync_timeout.seconds)
                self._restart(failure)

    def _engine_death(self, error: Exception) -> WorkerFailed:
        """The engine's death `error` reports; raises the run's failure instead when it reports something else
        (a training rank's failure, an engine's error while alive) or no restart is left."""
        failure = error if isinstance(error, WorkerFailed) else worker_failure(error, [self.engines, self.trainers])
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
        return failure

    def _restart(self, failure: WorkerFailed) -> int:
        """Start engine `failure.index` again on its devices, in the other engines' memory state; its index."""
        index = failure.index
        self.used += 1
        say(
            f"relax: {failure}; starting it again on its devices (engine restart {self.used} of at most "
            f"{self.max_restarts}, --max-engine-restarts)", error=True,
        )
        start = time.perf_counter()
        awake = self.actor_awake
        if awake:  # the new engine allocates its memory as at the run's start, with the devices to itself
            self._actor("sleep")
        self.engines.restart(index)
        new_engine = self.engines.actors[index]
        wait_for([new_engine.watched_child_pids.remote()], self.engines.placement, self.start_timeout,
                 [(self.engines, index)])
        released = [tag for tag in MEMORY_TAGS if tag not in self.engine_memory]
        if released:
            wait_for([new_engine.release_memory_occupation.remote(released)], self.engines.placement,
                     self.sync_timeout, [(self.engines, index)])
        if awake:
            self._actor("wake")
        self.stale.add(index)
        for key in [key for key, call in self._groups.items() if call.engine == index]:  # lost with the engine
            if self._aborting:
                self._return_aborted(key)
            else:
                self._groups[key] = self._groups[key]._replace(engine=None, ref=None, deadline=None)
        if self.used == self.max_restarts and self.trainers is not None:
            self.trainers.watched = None  # no restart left: an engine's death fails the run in any phase, at once
        self._untaken += 1
        self._untaken_seconds += time.perf_counter() - start
        return index

    def take_faults(self) -> dict:
        """faults/engine_restarts and faults/engine_restart_seconds since the last call (none without engines)."""
        if self.engines is None:
            return {}
        faults = {"faults/engine_restarts": self._untaken, "faults/engine_restart_seconds": self._untaken_seconds}
        self._untaken, self._untaken_seconds = 0, 0.0
        return faults


def is_engine_death(error: Exception) -> bool:
    """Whether `error`, which names an engine, is its death (or silence: a timeout), which a restart may cure, not
    an error it raised while alive (a bug or a bad input; a request SGLang refuses is neither: RolloutEngine.generate
    returns it as a failed Completion). A call through a training rank (the push) carries the engine's error as
    its cause."""
    if isinstance(error, WorkerFailed):  # the liveness watch, or no answer in time
        return True
    origin = error
    while isinstance(getattr(origin, "cause", None), ray.exceptions.RayError):
        origin = origin.cause
    return isinstance(origin, ray.exceptions.RayActorError) or isinstance(getattr(origin, "cause", None),
                                                                            EngineDeadError)
