"""The colocated RL loop. `run` reads top to bottom: set up (started_run: the training actors, then the engines;
then the checkpoint resumed from), then one colocated step per iteration, then the evaluation after the last step.
With --no-colocate, relax.run.loop_async runs instead, on the same setup and phases.

One step: the rollout (relax.rollout.api: generate and score, or replay); release the engines' memory; wake the
actor; old-policy (and reference) logprobs and advantages; train; push the new weights to the engines and put the
actor to sleep; resume the engines. The device hand-overs (and an engine's restart in any phase) are
relax.run.colocation's; the other phases are plain functions below `run`. The `faults.inject` lines are the tests'
named fault points (relax.ray.faults): nothing is due in a real run.

Evaluation (--eval-prompt-data) runs on the engines while the actor sleeps, so it needs no device memory of its
own: before a step's rollout when one is due (step 0, every --eval-interval steps) and after the last step's weight
push; the metrics of the policy after s steps are logged at step s (relax.rollout.evaluation).

Debug modes run the same phases without one side: --debug-rollout-only creates no training actor (generate,
score, save); --debug-train-only creates no engines and trains on rollouts replayed by --load-rollout-data.
--eval-only creates no training actor and runs no step: it evaluates --hf-checkpoint once.

The driver waits on every phase through relax.ray.placement.wait_for (ActorGroup.run for a call on every actor of a
group), which also watches the run's actors (and an engine's SGLang processes): a worker that dies fails the run
within seconds, whichever phase the driver is waiting on, and a call that may hang is bounded
(--engine-start-timeout, --rollout-timeout, --weight-sync-timeout, --train-timeout). The exception: an engine that
dies in any phase is started again in place and the phase goes on (relax.run.colocation; --max-engine-restarts).
With --max-restarts, run_with_restarts resumes a run whose training rank or engine failed (an engine past its
in-place restarts) from its newest checkpoint, on workers started anew. A checkpoint of the last step is resumed
too: what remains is the weight push and the evaluation after the last step.

A signal to the driver (SIGINT / SIGTERM, StopOnSignal) ends the run after the step it came in, that step saved
with --save (stop_run); the evaluations still due are not run, the one after the last step included.

Weight push order: the actor pushes while awake (engines' weights resumed, their KV cache still
released), then sleeps. Exporting from a sleeping actor's host copy, which would lower the peak by the
actor's weights, is not built yet.
"""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import ray
import torch

from relax.args.settings import AlgorithmSettings, EvalSettings, RolloutSettings, RunSettings
from relax.console import say
from relax.metric_names import extreme
from relax.run.metrics import MetricsLog
from relax.ray.faults import FaultPlan
from relax.ray.placement import (
    ENGINE, TRAINING_RANK, ActorGroup, Placement, WorkerFailed, create_engine_actors, create_node_placement,
    create_training_actors, worker_failure,
)
from relax.ray.watch import Timeout
from relax.rollout.api import Filling, GenerateAndScore, Replay, Rollout, RolloutRequest
from relax.rollout.data import PromptLoader
from relax.rollout.dump import save_rollout_data
from relax.rollout.engine_fields import admission_holdback
from relax.rollout.evaluation import EvalSet, eval_due, evaluate
from relax.rollout.groups import Sample, apply_overlong_penalty, group_sizes
from relax.rollout.rollout import (
    EnginePool, Generate, most_groups_in_flight, most_requests_per_engine, reward_and_length_metrics,
)
from relax.rollout.worker import EngineWorker, engine_actor_class
from relax.run.colocation import Colocation
from relax.run.inputs import Inputs
from relax.run.state import Checkpoint, RunStopped, StopOnSignal, sampling_seed, save, save_due
from relax.train.algorithms import compute_advantages
from relax.train.batch import RolloutBatch, optimizer_step_sizes, split_over_data_parallel
from relax.train.saved_steps import LATEST
from relax.train.worker import TrainWorker


def run(
    config, inputs: Inputs, stop: StopOnSignal | None = None, restarts: int = 0, faults: FaultPlan | None = None
) -> Path:
    """Train as `config` (relax.args.TrainConfig: settings built and checked at parse time) says, on `inputs`
    (relax.run.inputs: read before any worker starts); returns the output directory. With `stop` (entered by the
    `relax train` driver), a signal ends the run after its current step with RunStopped (stop_run), also after the
    last step: the evaluation after it is then not run. `restarts`: how often the run restarted before this attempt
    (run_with_restarts), logged as faults/run_restarts in every row; a restart resumes a checkpoint of the last step
    too (Inputs.resumed), which runs no step. `faults`: the tests' injected faults (relax.ray.faults; by default
    RELAX_INJECT_FAULTS')."""
    with started_run(config, inputs, stop, restarts, faults) as run_:
        settings, outputs = config.run, config.outputs
        workers, faults, loader = run_.workers, run_.faults, run_.loader
        trainers, colocation = workers.trainers, workers.colocation
        if run_.checkpoint is not None:  # loaded awake, the engines' memory released, then pushed to them
            colocation.to_actor()
            load_checkpoint(trainers, run_.checkpoint, settings)
            colocation.to_engines()
        for step in range(run_.start_step, run_.num_steps):
            timer, train_metrics, saved = PhaseTimer(), {}, None
            faults.at(step)
            eval_metrics = run_.evaluate_policy(step)  # the policy this step samples from, while the actor sleeps
            with timer("perf/step_time"):
                with timer("perf/rollout_time"):
                    faults.inject("rollout", workers.engines, trainers)
                    samples, rollout_metrics = run_.collect_rollout(step)
                if trainers is not None:  # None under --debug-rollout-only
                    with timer("perf/train_wait_time"):
                        colocation.to_actor()
                    with timer("perf/train_time"):
                        train_metrics = train(
                            trainers, workers.data_parallel_ranks, samples, config.algorithm, settings.train_timeout
                        )
                    if save_due(outputs, run_.num_steps, step):  # while the actor is awake
                        with timer("perf/save_time"):
                            faults.inject("save", workers.engines, trainers)
                            saved = run_.save(step, loader)
                    with timer("perf/weight_sync_time"):
                        colocation.to_engines()
            run_.log.log(step, {**eval_metrics, **rollout_metrics, **train_metrics, **timer.seconds,
                                **colocation.take_faults()})
            if run_.stop.requested:  # a signal came during this step, which has ended (the last: no evaluation after)
                raise stop_run(run_, step, saved, loader, colocation.to_actor)
        run_.finish()  # the last step's weights pushed, the actor asleep
    return Path(config.outputs.output_dir)


@dataclass
class StartedRun:
    """What both loops (this one and relax.run.loop_async) run on, from started_run: the run's workers, its
    metrics log, its prompt loader and the phases bound to the run's settings."""

    config: object  # relax.args.TrainConfig
    stop: StopOnSignal
    faults: FaultPlan
    workers: "Workers"
    log: MetricsLog
    loader: PromptLoader | None  # None when rollouts are replayed
    checkpoint: Checkpoint | None  # the one resumed from
    start_step: int
    num_steps: int
    evaluate_policy: Callable[[int], dict]  # step -> the engines' policy's eval metrics, when due (evaluate_if_due)
    step_rollout: Rollout

    def collect_rollout(self, step: int) -> tuple[list[Sample], dict]:
        """Step `step`'s scored samples and their metrics, sampled with the step's own seeds."""
        settings, rollout = self.config.run, self.config.rollout
        sampling = replace(rollout.sampling, seed=sampling_seed(settings.seed, step))
        return collect_rollout(step, self.step_rollout, self.loader, sampling, rollout)

    def save(self, step: int, loader) -> Path:
        """The state after `step` (relax.run.state.save), `loader` where that step left it; the actor awake."""
        settings, outputs = self.config.run, self.config.outputs
        return save(outputs.save, step, self.workers.trainers, loader, settings.seed, outputs.save_hf,
                    settings.train_timeout)

    def finish(self) -> None:
        """After the last step, its weights pushed: the evaluation due then, and the weight-push groups closed."""
        workers = self.workers
        self.faults.at(self.num_steps)
        final_eval = self.evaluate_policy(self.num_steps)
        if final_eval:
            self.log.log_evaluation(self.num_steps, {**final_eval, **workers.colocation.take_faults()})
        if workers.trainers is not None and workers.engines is not None:
            # the broadcast groups to engines on other nodes (or devices)
            workers.trainers.run("close_weight_sync", timeout=self.config.run.train_timeout)


@contextmanager
def started_run(
    config, inputs: Inputs, stop: StopOnSignal | None, restarts: int, faults: FaultPlan | None
) -> Iterator[StartedRun]:
    """Ray (a local cluster unless the driver runs in one), the placement, the metrics log and the workers
    (start_workers) for `run`'s arguments; however the run ends, its workers, placement, log and local Ray are
    ended, and a worker's failure is raised as WorkerFailed naming it and its log."""
    settings, rollout, evaluation, outputs = config.run, config.rollout, config.evaluation, config.outputs
    num_steps = settings.num_steps if settings.mode.runs_steps else 0  # --eval-only: the evaluation at step 0 only
    stop = stop or StopOnSignal()  # not entered: never signalled
    checkpoint, eval_sets, reward_fn = inputs.checkpoint, inputs.eval_sets, inputs.reward_fn
    start_step = checkpoint.next_step if checkpoint else 0
    loader = inputs.loader(settings.seed, rollout.shuffle)
    from relax.platform import get_platform

    platform = get_platform(settings.device)

    started_ray = _init_ray()
    stop.take_back()  # ray.init set its own SIGTERM handler
    placement = create_node_placement(
        platform, settings.num_nodes, settings.num_devices_per_node, settings.rollout_num_devices or 0
    )
    workers = Workers()  # filled as each group is created, so that the cleanup ends those a failed setup created
    faults = faults or FaultPlan.from_environ()
    log = MetricsLog(
        Path(outputs.output_dir), num_steps, first_step=start_step, wandb_project=outputs.wandb_project,
        other_outputs={
            "checkpoints": outputs.save, "HF checkpoints": outputs.save_hf, "rollout data": rollout.save_data
        },
        restarts=restarts,
    )
    try:
        start_workers(workers, config, platform, placement, faults)
        if stop.requested:  # a signal came during the setup
            raise RunStopped(stop.signum, None, None)
        generate = workers.colocation.generate if workers.engines is not None else None
        evaluate_policy = partial(
            evaluate_if_due, generate, eval_sets, evaluation, reward_fn, settings.seed, num_steps,
            partial(faults.inject, "eval", workers.engines, workers.trainers),
        )
        yield StartedRun(
            config, stop, faults, workers, log, loader, checkpoint, start_step, num_steps, evaluate_policy,
            rollout_of(rollout, workers.colocation if workers.engines is not None else None, reward_fn),
        )
    except ray.exceptions.RayError as error:  # a worker died or raised: name it and its log
        raise worker_failure(error, [workers.trainers, workers.engines]) from error
    finally:
        log.close()
        if reward_fn is not None:  # its worker processes, if it has any
            reward_fn.close()
        workers.kill()
        placement.remove()
        if started_ray:  # the run's own local cluster: its processes end here, not at interpreter exit
            ray.shutdown()


def run_with_restarts(config, inputs: Inputs, stop: StopOnSignal | None = None, attempt=None) -> Path:
    """attempt(config, inputs, stop, restarts, faults): `run`, or relax.run.loop_async.run for --no-colocate (the
    `relax train` driver picks); after a worker fails, again from the newest complete checkpoint in --save (from
    where the run started while none is saved), at most --max-restarts times in all, then the failure is raised.
    The workers: a training rank, or an engine (its actor or SGLang processes) that died with --max-engine-restarts
    used up (the new attempt's engines have their own) or whose restart failed. run's cleanup has ended the failed
    attempt's workers (and the local Ray it started) before the next one starts them anew. The driver's own errors
    (bad input included) and a failure naming no worker (the liveness watch of a lost node) are raised at once, as
    is any failure after a stop signal."""
    attempt = attempt or run
    restarts = 0
    faults = FaultPlan.from_environ()  # one plan over the attempts: a resumed run does not meet its faults again
    while True:
        try:
            return attempt(config, inputs, stop, restarts, faults)
        except WorkerFailed as failure:
            restartable = failure.role in (TRAINING_RANK, ENGINE)
            if not restartable or restarts == config.run.max_restarts or (stop and stop.requested):
                raise
            restarts += 1
            saves = config.outputs.save
            load = saves if (Path(saves) / LATEST).is_file() else config.run.load
            say(
                f"relax train: {failure}\nrelax train: restart {restarts} of at most {config.run.max_restarts}: "
                f"resuming from {load or 'the start (nothing saved yet)'}",
                error=True,
            )
            config = replace(config, run=replace(config.run, load=load))
            inputs = inputs.resumed(config.run)


# --- phases ----------------------------------------------------------------------------------------------


def evaluate_if_due(
    generate: Generate, eval_sets: list[EvalSet], evaluation: EvalSettings, reward_fn, seed: int, num_steps: int,
    inject_fault, step: int,
) -> dict:
    """The eval/ metrics of the engines' policy after `step` steps, and perf/eval_time, when an evaluation is due
    then (relax.rollout.evaluation.eval_due); else none. `inject_fault()`: the tests' fault due as it begins."""
    if not eval_sets or not eval_due(step, num_steps, evaluation.interval):
        return {}
    timer = PhaseTimer()
    with timer("perf/eval_time"):
        inject_fault()
        metrics = evaluate(generate, eval_sets, evaluation.sampling, reward_fn, seed)
    return {**metrics, **timer.seconds}


def rollout_of(rollout: RolloutSettings, engines: EnginePool | None, reward_fn) -> Rollout:
    """The run's rollout (relax.rollout.api): the saved samples under --load-rollout-data, else the engines'
    responses scored, group by group (over-sampled with --over-sampling-batch-size, refilled with informative
    groups with --dynamic-sampling)."""
    if rollout.load_data:
        return Replay(rollout.load_data, with_routed_experts=rollout.routing_replay)
    filling = Filling(rollout.over_sampling_batch_size, rollout.dynamic_sampling, rollout.max_prompts, rollout.partial)
    return GenerateAndScore(engines, reward_fn, filling)


def collect_rollout(
    step, step_rollout: Rollout, loader, sampling, rollout: RolloutSettings
) -> tuple[list[Sample], dict]:
    """This step's scored samples (prompt by prompt) from `step_rollout` and their metrics; saved to
    --save-rollout-data. The overlong penalty comes last, so saved rewards and reward metrics are the reward
    function's own."""
    samples, sampling_metrics = step_rollout(RolloutRequest(step, loader, rollout.batch_size, sampling))
    if rollout.save_data:
        save_rollout_data(rollout.save_data, step, samples, rollout.sampling.n)
    metrics = {**reward_and_length_metrics(samples), **sampling_metrics}
    if rollout.overlong_buffer_len:
        apply_overlong_penalty(
            samples, rollout.max_response_len, rollout.overlong_buffer_len, rollout.overlong_penalty_factor
        )
    return samples, metrics


def train(
    trainers, data_parallel_ranks: list[int], samples: list[Sample], algorithm: AlgorithmSettings, timeout: Timeout
) -> dict:
    """Advantages, each over its prompt's group (a custom generate function's fan-out makes some larger); each
    data-parallel rank gets its token-balanced share of every optimizer step (as many optimizer steps as without
    fan-out, each holding more samples with it: relax.train.batch.optimizer_step_sizes); old-policy (and reference)
    logprobs and the optimizer steps on every rank (within `timeout`); mean metrics."""
    return training_metrics(trainers, start_training(trainers, data_parallel_ranks, samples, algorithm), timeout)


@dataclass
class Training:
    """A step's training, started on every rank (start_training), not yet waited on (training_metrics)."""

    calls: list  # one ref per training rank
    imbalance: float  # perf/data_parallel_token_imbalance


def start_training(trainers, data_parallel_ranks: list[int], samples: list[Sample], algorithm: AlgorithmSettings
                   ) -> Training:
    """train's calls, made and not waited on."""
    num_groups = len(group_sizes(samples, algorithm.group_size))
    batch = rollout_batch(samples, algorithm)
    step_sizes = optimizer_step_sizes(len(samples), num_groups, algorithm.group_size, algorithm.global_batch_size)
    shares, imbalance = split_over_data_parallel(batch.token_counts(), step_sizes, max(data_parallel_ranks) + 1)
    share_refs = [ray.put(batch.select(share.indices)) for share in shares]  # one copy per replica's TP/PP ranks
    calls = [
        actor.train.remote(share_refs[rank], shares[rank].step_sizes, algorithm.uses_reference)
        for actor, rank in zip(trainers.actors, data_parallel_ranks)
    ]
    return Training(calls, imbalance)


def training_metrics(trainers, training: Training, timeout: Timeout) -> dict:
    """Wait for `training` (within `timeout`); its mean metrics."""
    metrics = trainers.wait(training.calls, timeout)
    return {**_mean_over_steps(metrics[0]), "perf/data_parallel_token_imbalance": training.imbalance}


def stop_run(run_: StartedRun, last_step: int, saved, loader, wake_actor) -> RunStopped:
    """The run ends after `last_step` on a signal. With --save, that step's state is saved unless it just was
    (`loader` where that step left it; `wake_actor()` first, to give the actor its devices: the engines are not
    needed any more)."""
    if run_.config.outputs.save and saved is None:
        wake_actor()
        saved = run_.save(last_step, loader)
    return RunStopped(run_.stop.signum, last_step, saved)


def rollout_batch(samples: list[Sample], algorithm: AlgorithmSettings) -> RolloutBatch:
    """Token sequences, loss masks, per-token advantages, the engine's logprobs and (routing replay) its routed
    experts of the samples, for the training ranks."""
    lengths = [len(s.response_token_ids) for s in samples]
    loss_mask = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
    mask = torch.nn.utils.rnn.pad_sequence(loss_mask, batch_first=True)
    advantages = compute_advantages(
        algorithm.advantage_estimator,
        torch.tensor([s.reward for s in samples]),
        mask,
        group_size=group_sizes(samples, algorithm.group_size),
        normalize_std=algorithm.normalize_advantages_by_std,
    )
    return RolloutBatch(
        tokens=[s.prompt_ids + s.response_token_ids for s in samples],
        response_lengths=lengths,
        loss_mask=loss_mask,
        advantages=[advantages[i, :length] for i, length in enumerate(lengths)],
        rollout_logprobs=[torch.tensor(s.response_logprobs) for s in samples],
        routed_experts=[s.routed_experts for s in samples] if samples[0].routed_experts is not None else None,
    )


class PhaseTimer:
    """Wall-clock seconds of named phases (nested phases are timed independently)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - start


# --- setup ------------------------------------------------------------------------------------------------


@dataclass
class Workers:
    """The run's worker groups, each set as soon as it is created (start_workers), so that the run's cleanup ends
    every group a setup that failed half-way had created."""

    trainers: ActorGroup | None = None  # the training actors; none under --debug-rollout-only and --eval-only
    data_parallel_ranks: list[int] | None = None  # each training actor's
    engines: ActorGroup | None = None  # the rollout engines; none under --debug-train-only
    colocation: Colocation | None = None  # the hand-overs between the two, and the engines' restarts

    def kill(self) -> None:
        for group in (self.engines, self.trainers):
            if group is not None:
                group.kill()


def start_workers(workers: Workers, config, platform, placement: Placement, faults: FaultPlan) -> None:
    """Create the run's workers into `workers`: the training actors, colocated put to sleep so that the engines
    start with the device memory to themselves; then the engines, waited on until started (weights loaded, graphs
    captured: the first step would otherwise time it as rollout). With --no-colocate the actor takes the first
    --num-nodes x --num-devices-per-node bundles and the engines the rest, and nothing sleeps; with
    --rollout-num-devices 0 they share the bundles, nothing sleeps, and the engines start first, so that SGLang
    sizes their memory (--sglang-mem-fraction-static) before the actor's state takes its own."""
    settings, rollout = config.run, config.rollout
    memory_saver_on = settings.colocate and platform.has_memory_saver
    actor_devices = settings.num_nodes * settings.num_devices_per_node
    apart = not settings.colocate and settings.rollout_num_devices > 0
    actor_placement = placement.part(0, actor_devices) if apart else placement
    engine_placement = placement.part(actor_devices, placement.num_devices) if apart else placement
    beside = not settings.colocate and not apart
    if settings.mode.has_engines and beside:
        _start_engines(workers, config, platform, engine_placement, memory_saver_on)
    if settings.mode.has_actor:
        workers.trainers = trainers = create_training_actors(
            TrainWorker, actor_placement, memory_saver_on=memory_saver_on,
            args=(
                settings.hf_checkpoint, config.megatron.values, config.actor, platform.name,
                settings.update_weight_buffer_size, settings.megatron_features,
            ),
        )
        if settings.colocate:
            trainers.run("sleep", timeout=settings.weight_sync_timeout)
        workers.data_parallel_ranks = trainers.run("data_parallel_rank", timeout=settings.train_timeout)
    if settings.mode.has_engines and not beside:
        _start_engines(workers, config, platform, engine_placement, memory_saver_on)
    workers.colocation = Colocation(workers.trainers, workers.engines, rollout.devices_per_engine, settings, faults,
                                    engines_apart=apart)


def _start_engines(workers: Workers, config, platform, placement: Placement, memory_saver_on: bool) -> None:
    """The engine actors on `placement`, waited on until started. Says where SGLang would start only some of a
    rollout's requests at once (relax.rollout.engine_fields.admission_holdback)."""
    settings, rollout = config.run, config.rollout
    groups_in_flight = (most_groups_in_flight(rollout.batch_size, rollout.over_sampling_batch_size)
                        if settings.mode.reads_prompts else 0)
    workers.engines = engines = create_engine_actors(
        engine_actor_class(EngineWorker, groups_in_flight), placement,
        devices_per_engine=rollout.devices_per_engine, memory_saver_on=memory_saver_on,
        args=(config.sglang, settings.hf_checkpoint, platform.name, rollout.devices_per_engine, memory_saver_on,
              rollout.tools, rollout.custom_generate),
    )
    engines.run("watched_child_pids", timeout=settings.engine_start_timeout)  # returns once every engine started
    if settings.mode.reads_prompts:
        budgets = engines.run("admission_budget", timeout=settings.engine_start_timeout)
        holdback = admission_holdback(min(budgets, key=lambda budget: budget.kv_cache_tokens),
                                      most_requests_per_engine(rollout.over_sampling_batch_size, rollout.sampling.n,
                                                               len(engines.actors)),
                                      rollout.max_response_len)
        if holdback:
            say(f"relax: {holdback}")


def load_checkpoint(trainers: ActorGroup, checkpoint, settings: RunSettings) -> None:
    """The actor's state from the checkpoint resumed (relax.run.state.Checkpoint); the actor awake."""
    trainers.run("load_checkpoint", str(checkpoint.actor_dir), timeout=settings.train_timeout)


def _mean_over_steps(step_metrics: list[dict[str, float]]) -> dict[str, float]:
    """One value per metric for the rollout: the mean over its optimizer steps (the max or min for an extreme,
    relax.metric_names.extreme), under train/ unless the actor named its group (mismatch/)."""
    combined = {}
    for key in step_metrics[0]:
        values = [float(m[key]) for m in step_metrics]
        how = extreme(key)
        name = key if "/" in key else f"train/{key}"
        combined[name] = max(values) if how == "max" else min(values) if how == "min" else sum(values) / len(values)
    return combined


def _init_ray() -> bool:
    """Join the cluster this driver runs in (`ray job submit` sets RAY_ADDRESS), else start a local one.
    True when it started one."""
    import os

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return False
    # A local cluster for this run only: no dashboard, no usage reporting, no auth token written to ~/.ray.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, log_to_driver=True)
    return True
