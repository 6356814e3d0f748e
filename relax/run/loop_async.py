"""The RL loop with the engines and the actor running at once (--no-colocate), one step off-policy: the engines
generate step s+1's rollout while the actor trains on step s's.

    rollout(first step)                                   the weights the run starts from
    for each step s:
        train(s) started on the actor                     a Ray call, not waited on
        the evaluation due at s, then rollout(s+1)        on the engines meanwhile, with the weights after s steps
        wait for train(s); save when due
        push the new weights to the engines               nothing generates meanwhile
        log step s

So step s trains on samples of the policy after s - 1 steps (the first two steps: of the weights the run starts
from), one step behind the weights it updates; the engines' per-token logprobs ride with the samples and the
off-policy correction the flags set (TIS/MIS, relax.train.settings.RolloutCorrection) and the mismatch/ metrics
apply as colocated. Nothing sleeps or releases memory. With --rollout-num-devices N every engine is on devices the
actor does not hold and the weights go by the broadcast route (relax.sync.broadcast.plan_broadcasts) over the
platform's collective; with --rollout-num-devices 0 the engines run beside the actor on its devices, each keeping
the memory it took at the start (the engines start first), and the weights go as colocated (by handle on the same
device).

The setup, the phases, the evaluation after the last step and the cleanup are relax.run.loop's (started_run;
the requests go to the engines through relax.run.colocation.Colocation, which makes no hand-over here, and the
weights through its push); the checks at parse time (relax.args.checks.engines_have_their_own_devices) refuse what
this loop does not carry out: the debug modes and replayed rollouts.

An engine that dies in any phase is restarted in place as colocated (relax.run.colocation, --max-engine-restarts),
but it loaded --hf-checkpoint and cannot get the weights the others generate with: the actor is training them
further. So its groups, and the new ones, go to the engines not restarted since the last push while one is left (the
restarted one idles until the step's push). Once none is left (the only engine died), the rollout or evaluation waits
for the step's training, pushes its weights to every engine (all of them restarted then) and sends the held groups:
what they generate is of the next step's policy, and the rollout records its tokens so (Colocation.weights_ahead:
the per-token steps of --partial-rollout, --max-staleness and the rollout/partial_* ages); an evaluation that met this
mixes the two policies. The step then takes the training's metrics already waited for, and pushes only where an
engine was restarted since. A training rank that dies still fails the run (--max-restarts resumes it from its newest
checkpoint).

A checkpoint of step s holds the actor after train(s) and the prompt loader after step s's prompts; a resumed run
pushes that actor's weights to the engines and redoes rollout(s+1) with them, so its first step trains on-policy
where the uninterrupted run had trained one step behind; the sampling seeds are the step's own as always.
"""

import copy
import threading
import time
from functools import partial
from pathlib import Path

from relax.ray.faults import FaultPlan
from relax.ray.placement import ActorGroup
from relax.ray.watch import Timeout
from relax.run.colocation import Colocation
from relax.run.loop import (
    PhaseTimer, StartedRun, Training, load_checkpoint, start_training, started_run, stop_run, training_metrics,
)
from relax.run.inputs import Inputs
from relax.run.state import StopOnSignal, save_due


def run(
    config, inputs: Inputs, stop: StopOnSignal | None = None, restarts: int = 0, faults: FaultPlan | None = None
) -> Path:
    """relax.run.loop.run's contract (the same arguments, outputs and stops), for --no-colocate."""
    with started_run(config, inputs, stop, restarts, faults) as run_:
        workers = run_.workers
        colocation = workers.colocation
        colocation.beside_training(partial(refresh_weights, colocation, None))  # no training in flight
        if run_.checkpoint is not None:
            load_checkpoint(workers.trainers, run_.checkpoint, config.run)
            colocation.push()
        if run_.start_step < run_.num_steps:
            rollout = first_rollout(run_)
        for step in range(run_.start_step, run_.num_steps):
            rollout, saved, loader_after_step, row = step_overlapped(run_, step, rollout)
            run_.log.log(step, {**row, **workers.colocation.take_faults()})
            if run_.stop.requested:  # a signal came during this step, which has ended (the last: no evaluation after)
                raise stop_run(run_, step, saved, loader_after_step, wake_actor=lambda: None)  # the actor is awake
        run_.finish()  # the last step's weights pushed
    return Path(config.outputs.output_dir)


def first_rollout(run_: StartedRun) -> tuple[list, dict]:
    """The first step's rollout, before any training (the weights the run starts from), its seconds
    (perf/first_rollout_time) logged with its metrics."""
    timer = PhaseTimer()
    run_.faults.at(run_.start_step)
    with timer("perf/first_rollout_time"):
        run_.faults.inject("rollout", run_.workers.engines, run_.workers.trainers)
        samples, metrics = run_.collect_rollout(run_.start_step)
    return samples, {**metrics, **timer.seconds}


def step_overlapped(run_: StartedRun, step: int, rollout: tuple[list, dict]) -> tuple:
    """Step `step`: train on `rollout` (its samples and metrics) while the engines evaluate (when due) and generate
    the next step's rollout (the tests' faults at "rollout" of this step: relax.ray.faults); then save when due and
    push the new weights. Returns the next step's rollout
    (None after the last step), the checkpoint saved (or None), the prompt loader as this step left it (a copy:
    the next rollout has taken its prompts since), and the step's metrics row."""
    config, workers, faults = run_.config, run_.workers, run_.faults
    trainers, engines, colocation = workers.trainers, workers.engines, workers.colocation
    samples, rollout_metrics = rollout
    timer, saved, next_rollout = PhaseTimer(), None, None
    faults.at(step)
    loader_after_step = copy.copy(run_.loader)
    with timer("perf/step_time"):
        training = TrainingInFlight(
            trainers, start_training(trainers, workers.data_parallel_ranks, samples, config.algorithm),
            config.run.train_timeout,
        )
        colocation.beside_training(partial(refresh_weights, colocation, training))
        clock = TrainingClock(training.started.calls)
        eval_metrics = run_.evaluate_policy(step)  # the policy after `step` steps, while the actor trains
        if step + 1 < run_.num_steps:
            with timer("perf/rollout_time"):
                faults.inject("rollout", engines, trainers)
                next_rollout = run_.collect_rollout(step + 1)
        engines_done = time.perf_counter()
        with timer("perf/train_wait_time"):
            train_metrics = training.metrics()
        if save_due(config.outputs, run_.num_steps, step):
            with timer("perf/save_time"):
                faults.inject("save", engines, trainers)
                saved = run_.save(step, loader_after_step)
        with timer("perf/weight_sync_time"):
            if not colocation.weights_ahead or colocation.stale:  # else refresh_weights pushed them mid-rollout
                colocation.push()  # the weights the next rollout samples with, by the schedule
        colocation.beside_training(partial(refresh_weights, colocation, None))
        colocation.weights_ahead = 0
    row = {**eval_metrics, **rollout_metrics, **train_metrics, **timer.seconds, **clock.seconds(engines_done)}
    return next_rollout, saved, loader_after_step, row


class TrainingInFlight:
    """A step's training, started on the actor and waited on once: by the step after its rollout, or before that
    by an engine restart that left no engine with the weights the engines generate with (refresh_weights)."""

    def __init__(self, trainers: ActorGroup, started: Training, timeout: Timeout):
        self.trainers, self.started, self.timeout = trainers, started, timeout
        self._metrics: dict | None = None

    def metrics(self) -> dict:
        """The training's mean metrics, waited for (within `timeout`) at the first call."""
        if self._metrics is None:
            self._metrics = training_metrics(self.trainers, self.started, self.timeout)
        return self._metrics


def refresh_weights(colocation: Colocation, training: TrainingInFlight | None) -> None:
    """Colocation's way to give every engine the actor's weights once every engine was restarted since the last
    push: wait for the step's `training` (None: none is in flight, the actor holds the weights the engines generate
    with), then push. The weights after it are a step ahead of those the rollout's step samples with, by the
    schedule (weights_ahead)."""
    if training is not None:
        training.metrics()
    colocation.push(inject_faults=False)
    if training is not None:
        colocation.weights_ahead = 1


class TrainingClock:
    """When a step's training (its calls on the training ranks) started and ended: Ray notes each call's end on
    its own thread, while the driver runs the engines' work."""

    def __init__(self, calls: list):
        self.started = time.perf_counter()
        self.ended: float | None = None
        self._left = len(calls)
        self._lock = threading.Lock()
        for call in calls:
            call.future().add_done_callback(self._one_ended)

    def _one_ended(self, _future) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.ended = time.perf_counter()

    def seconds(self, engines_done: float) -> dict[str, float]:
        """perf/train_time (the training, start to end) and perf/train_overlap_time (the part of it the engines
        spent generating: the evaluation and the next rollout, started with it and done at `engines_done`). Asked
        once the training was waited on."""
        ended = self.ended if self.ended is not None else time.perf_counter()
        return {
            "perf/train_time": ended - self.started,
            "perf/train_overlap_time": max(0.0, min(ended, engines_done) - self.started),
        }
