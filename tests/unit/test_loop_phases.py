"""The loop's pure pieces: batch assembly with advantages, phase timing, metrics files; and the control flow of run
and of --no-colocate's relax.run.loop_async.run (setup, steps, the evaluation after the last step, a stop signal,
cleanup) on test doubles of their workers."""

import json
import os
import signal
from dataclasses import dataclass, make_dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import relax.platform
import relax.run.inputs
import relax.run.loop
import relax.run.loop_async
from relax.args import AlgorithmSettings
from relax.args.settings import RunMode
from relax.run.loop import PhaseTimer, _mean_over_steps, rollout_batch, run, run_with_restarts
from relax.run.metrics import MetricsLog, read_metrics
from relax.ray.placement import ENGINE, TRAINING_RANK, WorkerFailed
from relax.run.inputs import Inputs
from relax.run.state import Checkpoint, RunStopped, StopOnSignal
from relax.train.saved_steps import LATEST, CheckpointError
from relax.rollout.data import Prompt
from relax.rollout.engine import SamplingConfig
from relax.rollout.engine_fields import AdmissionBudget
from relax.rollout.groups import Sample
from relax.rollout.worker import GENERATION


GRPO_IN_PAIRS = AlgorithmSettings(
    advantage_estimator="grpo", normalize_advantages_by_std=True, group_size=2, global_batch_size=4,
    uses_reference=False,
)


def _sample(prompt, response, reward):
    return Sample(prompt, response, [0.0] * len(response), "stop", reward=reward)


def test_rollout_batch_concatenates_prompt_and_response_and_normalises_rewards_per_group():
    p1, p2 = Prompt(1, [1, 2], "ab"), Prompt(2, [3], "c")
    samples = [_sample(p1, [5], 1.0), _sample(p1, [6, 7], 0.0), _sample(p2, [8, 9, 4], 0.5), _sample(p2, [4], 0.5)]
    batch = rollout_batch(samples, GRPO_IN_PAIRS)
    assert [t.tolist() for t in batch.tokens] == [[1, 2, 5], [1, 2, 6, 7], [3, 8, 9, 4], [3, 4]]
    assert batch.response_lengths == [1, 2, 3, 1]
    # group 1: rewards 1 and 0 -> +-1/std (std of [1, 0] is 0.7071); group 2: equal rewards -> 0
    assert batch.advantages[0].tolist() == pytest.approx([0.7071], abs=1e-3)
    assert batch.advantages[1].tolist() == pytest.approx([-0.7071] * 2, abs=1e-3)
    assert batch.advantages[2].tolist() == [0.0, 0.0, 0.0] and batch.advantages[3].tolist() == [0.0]


def test_a_sample_with_its_own_prompt_ids_trains_on_them_and_its_response_with_the_mask_over_the_response():
    prompt = Prompt(1, [1, 2], "ab")
    samples = [Sample(prompt, [5, 6], [-0.5, 0.0], "stop", loss_mask=[1, 0], own_prompt_ids=[9, 8, 1, 2]),
               _sample(prompt, [7], 0.0)]
    batch = rollout_batch(samples, GRPO_IN_PAIRS)
    assert [t.tolist() for t in batch.tokens] == [[9, 8, 1, 2, 5, 6], [1, 2, 7]]
    assert batch.response_lengths == [2, 1]
    assert [m.tolist() for m in batch.loss_mask] == [[1.0, 0.0], [1.0]]
    assert [t.tolist() for t in batch.rollout_logprobs] == [[-0.5, 0.0], [0.0]]


def test_phase_timer_records_each_phase_even_when_it_raises():
    timer = PhaseTimer()
    with timer("a"):
        pass
    with pytest.raises(ValueError), timer("b"):
        raise ValueError
    assert set(timer.seconds) == {"a", "b"} and all(v >= 0 for v in timer.seconds.values())


def test_mean_over_optimizer_steps_is_prefixed():
    assert _mean_over_steps([{"loss": 1.0, "lr": 2.0}, {"loss": 3.0, "lr": 2.0}]) == {"train/loss": 2.0, "train/lr": 2.0}


def test_mismatch_metrics_keep_their_group_and_extremes_combine_by_extreme():
    steps = [
        {"loss": 1.0, "mismatch/ratio_mean": 1.0, "mismatch/ratio_max": 3.0, "mismatch/ratio_min": 0.5},
        {"loss": 3.0, "mismatch/ratio_mean": 2.0, "mismatch/ratio_max": 2.0, "mismatch/ratio_min": 0.25},
    ]
    assert _mean_over_steps(steps) == {
        "train/loss": 2.0, "mismatch/ratio_mean": 1.5, "mismatch/ratio_max": 3.0, "mismatch/ratio_min": 0.25,
    }


def test_rollout_batch_carries_the_engine_logprobs():
    prompt = Prompt(1, [1, 2], "ab")
    samples = [Sample(prompt, [5, 6], [-0.5, -1.5], "stop", reward=1.0), Sample(prompt, [7], [-2.0], "stop")]
    assert [t.tolist() for t in rollout_batch(samples, GRPO_IN_PAIRS).rollout_logprobs] == [[-0.5, -1.5], [-2.0]]


def test_rollout_batch_carries_each_samples_loss_mask_and_an_untrained_token_gets_no_advantage():
    prompt = Prompt(1, [1, 2], "ab")
    samples = [Sample(prompt, [5, 6, 7], [-0.5, 0.0, -1.5], "stop", reward=1.0, loss_mask=[1, 0, 1]),
               Sample(prompt, [7], [-2.0], "stop", reward=0.0)]
    batch = rollout_batch(samples, GRPO_IN_PAIRS)
    assert [m.tolist() for m in batch.loss_mask] == [[1.0, 0.0, 1.0], [1.0]]
    assert batch.advantages[0].tolist() == pytest.approx([0.7071, 0.0, 0.7071], abs=1e-3)


def test_rollout_batch_carries_the_engines_routed_experts_when_the_samples_have_them():
    prompt = Prompt(1, [1, 2], "ab")
    experts = [torch.full((3, 2, 2), 1, dtype=torch.int16), torch.full((2, 2, 2), 3, dtype=torch.int16)]
    samples = [Sample(prompt, [5, 6], [-0.5, -1.5], "stop", routed_experts=experts[0]),
               Sample(prompt, [7], [-2.0], "stop", routed_experts=experts[1])]
    assert rollout_batch(samples, GRPO_IN_PAIRS).routed_experts == experts
    for sample in samples:
        sample.routed_experts = None
    assert rollout_batch(samples, GRPO_IN_PAIRS).routed_experts is None


def test_metrics_log_writes_jsonl_tensorboard_and_reward_curve(tmp_path):
    log = MetricsLog(tmp_path, num_steps=2)
    log.log(0, {"rollout/reward_mean": 0.1, "perf/step_time": torch.tensor(1.5).item()})
    log.log(1, {"rollout/reward_mean": 0.7, "perf/step_time": 1.2})
    png = log.close()
    assert [r["rollout/reward_mean"] for r in read_metrics(tmp_path / "metrics.jsonl")] == pytest.approx([0.1, 0.7])
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class _Run:  # the RunSettings fields run_with_restarts reads
    load: str | None
    max_restarts: int


@dataclass(frozen=True)
class _Outputs:
    save: str


@dataclass(frozen=True)
class _Config:
    run: _Run
    outputs: _Outputs


class _Inputs:  # what run_with_restarts asks of the inputs: those of a restart (relax.run.inputs.Inputs.resumed)
    def resumed(self, run):
        return self


def test_a_run_restarts_after_training_rank_failures_from_its_newest_save_at_most_max_restarts_times(
    tmp_path, monkeypatch, capsys
):
    attempts = []  # (load, restarts) of each run() call

    def run(config, inputs, stop, restarts, faults):  # fails twice: before its first save, then after one
        attempts.append((config.run.load, restarts))
        if len(attempts) == 2:
            (tmp_path / LATEST).write_text("step_000001\n")
        if len(attempts) <= 2:
            raise WorkerFailed(f"training rank 0 (TrainWorker, pid {len(attempts)}) failed: died", role=TRAINING_RANK)
        return tmp_path / "out"

    monkeypatch.setattr(relax.run.loop, "run", run)
    config = _Config(_Run(load=None, max_restarts=2), _Outputs(save=str(tmp_path)))
    assert run_with_restarts(config, _Inputs()) == tmp_path / "out"
    assert attempts == [(None, 0), (None, 1), (str(tmp_path), 2)]
    messages = capsys.readouterr().err.splitlines()
    assert messages[1] == "relax train: restart 1 of at most 2: resuming from the start (nothing saved yet)"
    assert messages[3] == f"relax train: restart 2 of at most 2: resuming from {tmp_path}"

    attempts.clear()
    (tmp_path / LATEST).unlink()
    with pytest.raises(WorkerFailed, match="pid 2"):  # the bound reached: the failure is the run's
        run_with_restarts(_Config(_Run(load="earlier", max_restarts=1), _Outputs(save=str(tmp_path))), _Inputs())
    assert attempts == [("earlier", 0), ("earlier", 1)]  # nothing saved yet: from where the run started


def test_a_run_restarts_after_an_engine_failure_but_not_after_a_driver_error_or_a_failure_naming_no_worker(
    tmp_path, monkeypatch
):
    failures = [  # the first attempt's, then the second's
        WorkerFailed("engine 0 (EngineWorker, pid 1) failed: died (no engine restart left)", role=ENGINE),
        CheckpointError("--load saves: the checkpoint was made with --seed 1"),
    ]
    attempts = []

    def run(config, inputs, stop, restarts, faults):
        attempts.append(restarts)
        raise failures[restarts]

    monkeypatch.setattr(relax.run.loop, "run", run)
    config = _Config(_Run(load=None, max_restarts=3), _Outputs(save=str(tmp_path)))
    with pytest.raises(CheckpointError, match="--seed 1"):
        run_with_restarts(config, _Inputs())
    assert attempts == [0, 1]

    attempts.clear()
    failures[0] = WorkerFailed("the liveness watch of the engines on one node ended (the node lost?): gone")
    with pytest.raises(WorkerFailed, match="liveness watch"):
        run_with_restarts(config, _Inputs())
    assert attempts == [0]


# --- run's control flow, on test doubles of the workers (no Ray, no engine, no actor) ---------------------------


class _Group:
    """An ActorGroup double: a call's refs name the group and the method; run() and wait() wait on them through
    `wait_for` (the world's); kill() is recorded."""

    def __init__(self, role: str, wait_for):
        self.role, self.killed, self.wait_for = role, False, wait_for
        self.placement, self.actors, self.bundles = None, [role], [SimpleNamespace(node_id="node")]

    def __len__(self) -> int:
        return 1

    def call(self, method: str, *args) -> list:
        return [(self.role, method)]

    def run(self, method: str, *args, timeout=None) -> list:
        return self.wait(self.call(method, *args))

    def wait(self, refs: list, timeout=None) -> list:
        return self.wait_for(refs)

    def kill(self) -> None:
        self.killed = True


class _Colocation:
    """Colocation's double: `untaken` engine restarts since the last take_faults(); the hand-overs recorded."""

    def __init__(self):
        self.untaken, self.hand_overs = 0, []
        self.stale, self.weights_ahead = set(), 0  # no engine restarted since the last push; weights as scheduled

    def to_actor(self) -> None:
        self.hand_overs.append("to_actor")

    def to_engines(self) -> None:
        self.hand_overs.append("to_engines")

    def generate(self, prompts, sampling):
        raise AssertionError("the rollouts and evaluations are replaced")

    def take_faults(self) -> dict:
        count, self.untaken = self.untaken, 0
        return {"faults/engine_restarts": count}


# What the groups' methods answer, where 0 will not do: an engine whose KV cache starts every request at once.
ANSWERS = {"admission_budget": AdmissionBudget(kv_cache_tokens=1 << 30, conservativeness=1.0, init_ratio=0.7,
                                               reserve_clip=4096, max_running_requests=1024)}


class _World:
    """What run() would create, replaced by doubles in relax.run.loop: the platform, Ray, the placement, the
    workers' groups, the evaluations and rollouts (recorded by step). `wait_for` (the groups' run and wait)
    answers a call's refs, or raises `fails` for the call named there."""

    def __init__(self, monkeypatch, fails: tuple[tuple[str, str], Exception] | None = None):
        self.groups, self.evaluated, self.ray_shut_down, self.placement_removed = {}, [], False, False
        self.colocation = _Colocation()
        self.on_rollout = self.on_evaluation = lambda step: None
        loop = relax.run.loop
        platform = SimpleNamespace(name="cpu", has_memory_saver=False)
        monkeypatch.setattr(relax.platform, "get_platform", lambda name: platform)
        monkeypatch.setattr(loop, "_init_ray", lambda: True)
        monkeypatch.setattr(loop.ray, "shutdown", lambda: setattr(self, "ray_shut_down", True))
        placement = SimpleNamespace(remove=lambda: setattr(self, "placement_removed", True))
        monkeypatch.setattr(loop, "create_node_placement", lambda *args: placement)
        monkeypatch.setattr(loop, "create_training_actors", lambda *args, **kwargs: self._group("trainers"))
        monkeypatch.setattr(loop, "create_engine_actors", self._create_engines)
        monkeypatch.setattr(loop, "Colocation", self._colocation)

        self.waited = []  # the refs of every wait_for call

        def wait_for(refs, *args):
            nonlocal fails
            self.waited.append(refs)
            if fails is not None and refs == [fails[0]]:
                failure, fails = fails[1], None  # once: a restarted run gets past it
                raise failure
            return [ANSWERS.get(method, 0) for _, method in refs]  # data_parallel_rank: 0

        self.wait_for = wait_for

        def evaluate_if_due(generate, eval_sets, evaluation, reward_fn, seed, num_steps, inject_fault, step):
            self.evaluated.append(step)
            self.on_evaluation(step)
            return {"eval/held_out/pass@1": 0.5, "perf/eval_time": 0.1}

        def collect_rollout(step, *args):
            self.on_rollout(step)
            return [], {"rollout/reward_mean": 0.25}

        monkeypatch.setattr(loop, "evaluate_if_due", evaluate_if_due)
        monkeypatch.setattr(loop, "collect_rollout", collect_rollout)

    def _create_engines(self, engine_class, *args, **kwargs):
        self.engine_class = engine_class
        return self._group("engines")

    def _colocation(self, *args, engines_apart: bool) -> _Colocation:
        self.colocation.engines_apart = engines_apart
        return self.colocation

    def _group(self, role: str) -> _Group:
        self.groups[role] = _Group(role, self.wait_for)
        return self.groups[role]


NO_INPUTS = Inputs(report=[], checkpoint=None, prompts=None, eval_sets=[], reward_fn=None)  # what run() reads first


def _record(**fields):
    """A frozen dataclass instance of `fields` (run_with_restarts replaces the config's run.load)."""
    return make_dataclass("Record", list(fields), frozen=True)(**fields)


def _config(output_dir, num_steps: int, debug_rollout_only: bool, save=None, max_restarts: int = 0,
            colocate: bool = True):
    """The settings run() and run_with_restarts read (relax.args.TrainConfig's)."""
    settings = _record(
        num_steps=num_steps, load=None, device="cpu", seed=1, num_nodes=1, num_devices_per_node=1, colocate=colocate,
        rollout_num_devices=None if colocate else 1,
        hf_checkpoint="model", mode=RunMode.ROLLOUT_ONLY if debug_rollout_only else RunMode.TRAIN,
        update_weight_buffer_size=0, megatron_features=None, weight_sync_timeout=None, train_timeout=None,
        engine_start_timeout=None, max_restarts=max_restarts, max_engine_restarts=0,
    )
    outputs = _record(output_dir=str(output_dir), wandb_project=None, save=save, save_interval=None, save_hf=None)
    return _record(
        run=settings,
        rollout=SimpleNamespace(
            sampling=SamplingConfig(), devices_per_engine=1, save_data=None, load_data=None, dynamic_sampling=False,
            shuffle=False, batch_size=1, over_sampling_batch_size=1, max_prompts=10, partial=None, tools=None,
            custom_generate=None, max_response_len=SamplingConfig().max_new_tokens,
        ),
        evaluation=SimpleNamespace(), algorithm=None, megatron=SimpleNamespace(values=None), actor=None,
        sglang=None, outputs=outputs,
    )


def test_the_evaluation_after_the_last_step_logs_the_engines_restarted_during_it(tmp_path, monkeypatch):
    world = _World(monkeypatch)
    world.on_evaluation = lambda step: setattr(world.colocation, "untaken", 1 if step == 2 else 0)
    assert run(_config(tmp_path, num_steps=2, debug_rollout_only=True), NO_INPUTS) == tmp_path
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["faults/engine_restarts"]) for r in rows] == [(0, 0), (1, 0), (2, 1)]
    assert "perf/step_time" not in rows[-1] and world.groups["engines"].killed and world.ray_shut_down


def test_the_start_says_when_an_engine_would_start_only_part_of_a_rollouts_requests(tmp_path, monkeypatch, capsys):
    """The engine's KV cache (its scheduler's answer) against the rollout's requests per engine (over-sampling 64
    groups x 8 on one engine) and their response budget."""
    _World(monkeypatch)
    small = AdmissionBudget(kv_cache_tokens=100_000, conservativeness=1.0, init_ratio=0.7, reserve_clip=4096,
                            max_running_requests=1024)
    monkeypatch.setitem(ANSWERS, "admission_budget", small)
    config = _config(tmp_path, num_steps=1, debug_rollout_only=True)
    config.rollout.over_sampling_batch_size, config.rollout.sampling, config.rollout.max_response_len = (
        64, SamplingConfig(n=8), 2048)
    run(config, NO_INPUTS)
    assert ("relax: SGLang starts about 69 of the 512 requests an engine runs at once in a rollout"
            in capsys.readouterr().out)


def test_the_engines_have_a_generation_thread_for_every_group_a_rollout_may_have_in_flight(tmp_path, monkeypatch):
    world = _World(monkeypatch)
    config = _config(tmp_path, num_steps=1, debug_rollout_only=True)
    config.rollout.batch_size, config.rollout.over_sampling_batch_size = 1024, 2048
    run(config, NO_INPUTS)
    assert world.engine_class.__ray_metadata__.concurrency_groups == {GENERATION: 1024 + 2048 - 1 + 1}


def test_a_signal_during_the_last_step_stops_the_run_after_it_without_the_evaluation_after_it(tmp_path, monkeypatch):
    world = _World(monkeypatch)
    with StopOnSignal() as stop:
        world.on_rollout = lambda step: os.kill(os.getpid(), signal.SIGTERM) if step == 1 else None
        with pytest.raises(RunStopped) as stopped:
            run(_config(tmp_path, num_steps=2, debug_rollout_only=True), NO_INPUTS, stop)
    assert (stopped.value.signum, stopped.value.last_step, stopped.value.saved) == (signal.SIGTERM, 1, None)
    assert world.evaluated == [0, 1]  # not 2, the evaluation after the last step
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
    assert world.groups["engines"].killed and world.placement_removed and world.ray_shut_down


def test_a_setup_that_fails_half_way_ends_the_workers_it_created(tmp_path, monkeypatch, capsys):
    # The engines were created and the training actors before them, then the engines failed to start.
    failure = WorkerFailed("engine 0 (EngineWorker, pid 1) failed: died", role="engine")
    world = _World(monkeypatch, fails=(("engines", "watched_child_pids"), failure))
    with pytest.raises(WorkerFailed, match="engine 0"):
        run(_config(tmp_path, num_steps=2, debug_rollout_only=False), NO_INPUTS)
    assert world.groups["trainers"].killed and world.groups["engines"].killed
    assert world.placement_removed and world.ray_shut_down and world.evaluated == []
    assert "  steps         none finished\n" in capsys.readouterr().out  # the metrics log closed too


def test_a_training_rank_failing_after_the_final_save_restarts_to_the_evaluation_after_the_last_step(
    tmp_path, monkeypatch, capsys
):
    failure = WorkerFailed("training rank 0 (TrainWorker, pid 1) failed: died", role=TRAINING_RANK)
    world = _World(monkeypatch, fails=(("trainers", "close_weight_sync"), failure))
    loop, saves, loaded = relax.run.loop, tmp_path / "saves", []
    monkeypatch.setattr(loop, "train", lambda *args: {"train/loss": 1.0})

    def save(save_dir, step, *args):  # the actor's checkpoint and the loop's state, as far as the loop sees them
        Path(save_dir).mkdir(exist_ok=True)
        (Path(save_dir) / LATEST).write_text(f"step_{step:06d}\n")
        return Path(save_dir) / f"step_{step:06d}"

    def read_checkpoint(load, hf_checkpoint, seed, num_steps, finished_ok):  # the last step's, taken on a restart
        loaded.append((load, finished_ok))
        return Checkpoint(Path(load) / "step_000001", next_step=2, seed=seed, loader_state=None)

    monkeypatch.setattr(loop, "save", save)
    monkeypatch.setattr(relax.run.inputs, "read_checkpoint", read_checkpoint)
    config = _config(tmp_path / "out", num_steps=2, debug_rollout_only=False, save=str(saves), max_restarts=1)
    assert run_with_restarts(config, NO_INPUTS) == tmp_path / "out"
    assert loaded == [(str(saves), True)]  # the restart takes the checkpoint of the last step
    assert world.evaluated == [0, 1, 2, 2]  # the restart ran no step, only the evaluation after the last one
    assert world.waited[-1] == [("trainers", "close_weight_sync")] and world.groups["trainers"].killed
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [(r["step"], r["faults/run_restarts"], "perf/step_time" in r) for r in rows] == [
        (0, 0, True), (1, 0, True), (2, 1, False)  # the failed attempt's evaluation row replaced
    ]
    assert "  restarts      1: resumed from a checkpoint after a training rank or an engine failed\n" in (
        capsys.readouterr().out
    )


# --- --no-colocate: relax.run.loop_async.run on the same doubles ------------------------------------------------


class _AsyncWorld(_World):
    """_World, with the async loop's own calls recorded in `events` in the order the driver makes them: each
    step's rollout takes one prompt from the loader, training starts and is waited on, saves, weight pushes."""

    def __init__(self, monkeypatch):
        super().__init__(monkeypatch)
        self.events = []
        loop, loop_async = relax.run.loop, relax.run.loop_async

        def collect_rollout(step, step_rollout, loader, sampling, rollout):
            loader.take(1)
            self.events.append(("rollout", step))
            self.on_rollout(step)
            return [f"sample of step {step}"], {"rollout/reward_mean": float(step)}

        def start_training(trainers, data_parallel_ranks, samples, algorithm):
            self.events.append(("train started", samples[0]))
            return SimpleNamespace(calls=samples)

        def training_metrics(trainers, training, timeout):
            self.events.append(("train waited", training.calls[0]))
            return {"train/loss": 1.0}

        def save(save_dir, step, trainers, loader, *args):
            self.events.append(("save", step, loader.state_dict()["index"]))
            return Path(save_dir) / f"step_{step:06d}"

        self.placed = []  # create_node_placement's sizes, then each part the workers are placed on
        placement = SimpleNamespace(
            remove=lambda: setattr(self, "placement_removed", True), num_devices=2,
            part=lambda start, stop: self.placed.append(("part", start, stop)),
        )
        monkeypatch.setattr(
            loop, "create_node_placement", lambda platform, *sizes: self.placed.append(sizes) or placement
        )
        self.on_evaluation = lambda step: self.events.append(("eval", step))
        monkeypatch.setattr(loop, "collect_rollout", collect_rollout)
        monkeypatch.setattr(loop, "save", save)
        monkeypatch.setattr(loop_async, "start_training", start_training)
        monkeypatch.setattr(loop_async, "training_metrics", training_metrics)
        self.colocation.push = lambda inject_faults=True: self.events.append(("push", self.colocation.engines_apart))
        self.colocation.beside_training = lambda refresh_weights: setattr(self, "refresh_weights", refresh_weights)
        self.colocation.weights_ahead = 0
        clock = SimpleNamespace(seconds=lambda engines_done: {"perf/train_time": 2.0, "perf/train_overlap_time": 1.5})
        monkeypatch.setattr(loop_async, "TrainingClock", lambda calls: clock)


def _inputs_with_prompts(count: int) -> Inputs:
    prompts = [Prompt(row, [row], f"prompt {row}") for row in range(1, count + 1)]
    return Inputs(report=[], checkpoint=None, prompts=prompts, eval_sets=[], reward_fn=None)


def test_the_async_loop_rolls_out_the_next_step_while_the_actor_trains_and_pushes_between_steps(
    tmp_path, monkeypatch
):
    world = _AsyncWorld(monkeypatch)
    config = _config(tmp_path, num_steps=3, debug_rollout_only=False, save=str(tmp_path / "saves"), colocate=False)
    assert run_with_restarts(config, _inputs_with_prompts(8), attempt=relax.run.loop_async.run) == tmp_path
    assert world.events == [
        ("rollout", 0),  # the weights the run starts from
        ("train started", "sample of step 0"), ("eval", 0), ("rollout", 1), ("train waited", "sample of step 0"),
        ("push", True),  # step 1 rolled out on the starting weights too: one step off-policy from here on
        ("train started", "sample of step 1"), ("eval", 1), ("rollout", 2), ("train waited", "sample of step 1"),
        ("push", True),
        ("train started", "sample of step 2"), ("eval", 2), ("train waited", "sample of step 2"),
        ("save", 2, 3),  # the loader after step 2's prompt: the next rollout's was not taken (no step 3)
        ("push", True),
        ("eval", 3),  # after the last push: the policy after 3 steps
    ]
    assert world.placed == [(1, 1, 1), ("part", 0, 1), ("part", 1, 2)]  # 1 x 1 devices for the actor, then 1
    assert world.colocation.hand_overs == []  # nothing sleeps, nothing is released
    assert ["trainers", "sleep"] not in world.waited
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["rollout/reward_mean"] for r in rows[:3]] == [0.0, 1.0, 2.0]  # the metrics of the samples trained
    assert "perf/first_rollout_time" in rows[0] and "perf/first_rollout_time" not in rows[1]
    assert ["perf/rollout_time" in r for r in rows[:3]] == [True, True, False]  # the next step's: none after the last
    assert all(r["perf/train_time"] == 2.0 and r["perf/train_overlap_time"] == 1.5 for r in rows[:3])
    assert world.groups["trainers"].killed and world.groups["engines"].killed and world.ray_shut_down


def test_an_async_rollout_left_without_engines_of_its_weights_waits_for_the_training_once_and_pushes(
    tmp_path, monkeypatch
):
    """Every engine restarted mid-rollout (Colocation calls refresh_weights): the rollout of step 2 waits for step
    1's training and pushes its weights, one step ahead of the schedule's; the step keeps the metrics waited for,
    and pushes nothing more."""
    world = _AsyncWorld(monkeypatch)
    ahead = []

    def on_rollout(step):
        if step == 2:
            world.refresh_weights()
        ahead.append((step, world.colocation.weights_ahead))

    world.on_rollout = on_rollout
    config = _config(tmp_path, num_steps=3, debug_rollout_only=False, save=str(tmp_path / "saves"), colocate=False)
    assert run_with_restarts(config, _inputs_with_prompts(8), attempt=relax.run.loop_async.run) == tmp_path
    assert world.events[6:11] == [
        ("train started", "sample of step 1"), ("eval", 1), ("rollout", 2),
        ("train waited", "sample of step 1"), ("push", True),  # mid-rollout, by refresh_weights
    ]
    # no second wait, and no second push of the same weights
    assert world.events[11:13] == [("train started", "sample of step 2"), ("eval", 2)]
    assert ahead == [(0, 0), (1, 0), (2, 1)]  # the rollout's tokens recorded as step 3's policy's; reset after
    assert world.colocation.weights_ahead == 0
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["train/loss"] for r in rows[:3]] == [1.0, 1.0, 1.0]


def test_an_engine_restarted_after_the_mid_rollout_push_gets_the_steps_push(tmp_path, monkeypatch):
    world = _AsyncWorld(monkeypatch)

    def on_rollout(step):
        if step == 2:
            world.refresh_weights()
            world.colocation.stale = {0}  # restarted again after it: --hf-checkpoint's weights

    world.on_rollout = on_rollout
    config = _config(tmp_path, num_steps=3, debug_rollout_only=False, save=str(tmp_path / "saves"), colocate=False)
    assert run_with_restarts(config, _inputs_with_prompts(8), attempt=relax.run.loop_async.run) == tmp_path
    assert world.events[10:13] == [("push", True), ("push", True), ("train started", "sample of step 2")]


def test_a_signal_stops_the_async_loop_after_its_step_saved_with_the_loader_before_the_next_rollout(
    tmp_path, monkeypatch
):
    world = _AsyncWorld(monkeypatch)
    config = _config(tmp_path, num_steps=4, debug_rollout_only=False, save=str(tmp_path / "saves"), colocate=False)
    with StopOnSignal() as stop:
        world.on_evaluation = lambda step: os.kill(os.getpid(), signal.SIGTERM) if step == 1 else None
        with pytest.raises(RunStopped) as stopped:
            relax.run.loop_async.run(config, _inputs_with_prompts(8), stop)
    assert (stopped.value.signum, stopped.value.last_step) == (signal.SIGTERM, 1)
    # step 1 trained, its rollout of step 2 done; the save of step 1 has the loader after step 1's prompt
    assert world.events[-4:] == [("rollout", 2), ("train waited", "sample of step 1"), ("push", True), ("save", 1, 2)]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
