"""relax.run.colocation's logic on doubles of the worker groups (no Ray): where each prompt group goes, which engine
errors restart an engine, and what a restart in each phase does, in order. The real engines and actor:
tests/e2e/test_loop_faults.py, tests/e2e/test_loop_two_engines.py."""

from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError, RayTaskError

import relax.run.colocation
from relax.ray.faults import FaultPlan
from relax.ray.placement import WorkerFailed
from relax.ray.watch import Timeout
from relax.rollout.data import Prompt
from relax.rollout.engine import EngineDeadError, SamplingConfig
from relax.rollout.rollout import most_requests_per_engine
from relax.run.colocation import Colocation, is_engine_death

SETTINGS = SimpleNamespace(
    max_engine_restarts=3, engine_start_timeout=Timeout(60, "--engine-start-timeout"),
    rollout_timeout=Timeout(60, "--rollout-timeout"), weight_sync_timeout=Timeout(60, "--weight-sync-timeout"),
)


def engine_raised(actor_id: str, cause: Exception, method: str = "generate"):
    """What ray.get raises when the engine actor's method raised `cause`."""
    return RayTaskError(
        method, f"Traceback (most recent call last):\n{cause!r}", cause, proctitle="ray::EngineWorker", pid=40,
        ip="10.0.0.1", actor_repr="<EngineWorker>", actor_id=actor_id,
    ).as_instanceof_cause()


class _Ref:
    def __init__(self, actor: "_Actor", method: str, args: tuple):
        self.actor, self.method, self.args = actor, method, args


class _Actor:
    """An actor double: `actor.method.remote(*args)` is logged and returns a ref; its calls named in `fails`
    (method -> error) fail once, when waited on."""

    def __init__(self, name: str, log: list, actor_id: str):
        self.name, self.log, self.fails = name, log, {}
        self._actor_id = SimpleNamespace(hex=lambda: actor_id)

    def __getattr__(self, method: str):
        def remote(*args):
            self.log.append((self.name, method, *args))
            return _Ref(self, method, args)

        return SimpleNamespace(remote=remote)


class _Group:
    """An ActorGroup double of `size` actors named `role` 0.., restart() starting `role` i' in place of actor i."""

    def __init__(self, role: str, size: int, log: list):
        self.role, self.log, self.watched, self.placement = role, log, None, None
        self.actors = [_Actor(f"{role} {i}", log, f"{role[0]}{i}" * 16) for i in range(size)]
        self.bundles = [SimpleNamespace(node_id="node")] * size

    def __len__(self) -> int:
        return len(self.actors)

    def describe(self, index: int) -> str:
        return f"{self.role} {index} (pid 4{index})"

    def restart(self, index: int) -> None:
        self.log.append(("restart", f"{self.role} {index}"))
        old = self.actors[index]
        self.actors[index] = _Actor(old.name + "'", self.log, old._actor_id.hex()[::-1])

    def call(self, method: str, *args, **kwargs) -> list:
        return [getattr(actor, method).remote(*args, *kwargs.values()) for actor in self.actors]

    def run(self, method: str, *args, timeout=None) -> list:
        return self.wait(self.call(method, *args))

    def wait(self, refs: list, timeout=None) -> list:
        return _wait_for(refs)


def _answer(ref):
    """A call's answer: for generate_group(prompt, sampling, prefixes, source) one completion per request (a
    sample, or a prefix continued), else a push report."""
    if ref.method != "generate_group":
        return {"bytes": 1}
    prompt, sampling, prefixes, _source, _evaluation = ref.args
    return ["completion"] * (sampling.n if prefixes is None else len(prefixes))


def _raise_failures(refs) -> None:
    for ref in refs:
        error = ref.actor.fails.pop(ref.method, None)
        if error is not None:
            raise error


def _wait_for(refs, *args) -> list:
    _raise_failures(refs)
    return [_answer(ref) for ref in refs]


def _first_done(refs, *args):
    """The earliest call completes first."""
    _raise_failures(refs)
    return refs[0]


@pytest.fixture
def world(monkeypatch):
    monkeypatch.setattr(relax.run.colocation, "wait_for", _wait_for)
    monkeypatch.setattr(relax.run.colocation, "first_done", _first_done)
    monkeypatch.setattr(relax.run.colocation.ray, "wait", lambda refs, **kwargs: (refs, []))
    monkeypatch.setattr(relax.run.colocation.ray, "get", _answer)
    log = []
    trainers, engines = _Group("training rank", 1, log), _Group("engine", 2, log)
    return SimpleNamespace(log=log, trainers=trainers, engines=engines,
                           colocation=Colocation(trainers, engines, 1, SETTINGS, FaultPlan()))


def test_only_the_engines_death_is_an_engine_death():
    assert is_engine_death(engine_raised("e0" * 16, EngineDeadError("its scheduler is gone")))
    assert is_engine_death(RayActorError("e0" * 16, "The actor died unexpectedly."))
    assert is_engine_death(WorkerFailed("engine 0 did not answer within --rollout-timeout 60 s"))
    assert not is_engine_death(engine_raised("e0" * 16, ValueError("a bug in the engine worker")))
    # Through a training rank's push: the engine's error is the cause of the rank's.
    pushed = RayTaskError(
        "push_weights", "Traceback", engine_raised("e0" * 16, EngineDeadError("gone"), "update_weights"),
        proctitle="ray::TrainWorker", pid=30, ip="10.0.0.1", actor_repr="<TrainWorker>", actor_id="t0" * 16,
    ).as_instanceof_cause()
    assert is_engine_death(pushed)


def test_an_error_of_a_live_engine_fails_the_run_without_a_restart(world):
    with pytest.raises(RuntimeError) as info:
        world.colocation._engine_death(engine_raised("e1" * 16, ValueError("a bug in the engine worker")))
    assert not isinstance(info.value, WorkerFailed)  # not a worker's death: a run restart would not help either
    assert str(info.value) == (
        "engine 1 (pid 41) failed: ValueError: a bug in the engine worker; the engine is alive, so restarting it "
        "would not help: a bug, or bad input"
    )
    death = world.colocation._engine_death(engine_raised("e1" * 16, EngineDeadError("its scheduler is gone")))
    assert (death.group, death.index) == (world.engines, 1)


def test_a_training_ranks_failure_is_raised_as_it_is(world):
    failure = WorkerFailed("training rank 0 failed: died", world.trainers, 0)
    with pytest.raises(WorkerFailed) as info:
        world.colocation._engine_death(failure)
    assert info.value is failure


def test_an_engine_dead_in_the_push_is_restarted_with_the_actor_asleep_and_the_push_made_again(world):
    world.colocation.to_actor()
    world.log.clear()
    world.trainers.actors[0].fails["push_weights"] = RayTaskError(
        "push_weights", "Traceback", engine_raised("e1" * 16, EngineDeadError("gone"), "update_weights"),
        proctitle="ray::TrainWorker", pid=30, ip="10.0.0.1", actor_repr="<TrainWorker>", actor_id="t0" * 16,
    ).as_instanceof_cause()
    world.colocation.to_engines()
    engines = [world.engines.actors[0], world.engines.actors[1]]
    assert [entry[:2] for entry in world.log] == [
        ("engine 0", "resume_memory_occupation"), ("engine 1", "resume_memory_occupation"),  # the weights
        ("training rank 0", "push_weights"),  # meets engine 1 dead
        ("training rank 0", "sleep"),  # the new engine starts with the devices to itself
        ("restart", "engine 1"),
        ("engine 1'", "watched_child_pids"),
        ("engine 1'", "release_memory_occupation"),  # into the others' state: only the weights held
        ("training rank 0", "wake"),
        ("training rank 0", "push_weights"),  # again, to the new engine too
        ("training rank 0", "sleep"),
        ("engine 0", "resume_memory_occupation"), ("engine 1'", "resume_memory_occupation"),  # the KV cache
    ]
    assert world.log[6][2] == ["kv_cache", "cuda_graph"] and world.log[8][2] == engines
    assert world.colocation.stale == set() and not world.colocation.actor_awake
    faults = world.colocation.take_faults()
    assert faults["faults/engine_restarts"] == 1 and faults["faults/engine_restart_seconds"] >= 0


def test_an_engine_dead_in_a_memory_call_is_called_again_once_restarted_and_given_the_weights_before_it_generates(
    world
):
    world.colocation.engine_memory = {"weights"}  # as after a push, resuming the KV cache (the actor asleep)
    world.engines.actors[1].fails["resume_memory_occupation"] = RayActorError("e1" * 16, "The actor died.")
    world.colocation._on_engines("resume_memory_occupation", ["kv_cache", "cuda_graph"])
    assert [entry[:2] for entry in world.log] == [
        ("engine 0", "resume_memory_occupation"), ("engine 1", "resume_memory_occupation"),  # dies
        ("restart", "engine 1"),  # the actor already sleeps
        ("engine 1'", "watched_child_pids"),
        ("engine 1'", "release_memory_occupation"),  # into the others' state
        ("engine 1'", "resume_memory_occupation"),  # the call it missed
    ]
    assert world.colocation.stale == {1}  # it holds --hf-checkpoint's weights
    world.log.clear()
    world.colocation.engine_memory = {"weights", "kv_cache", "cuda_graph"}
    completions = world.colocation.generate([Prompt(1, [1], "a"), Prompt(2, [2], "b")], SamplingConfig(n=2, seed=5))
    assert [entry[:2] for entry in world.log] == [  # the actor's weights to every engine first: two hand-overs
        *_weights_to(["engine 0", "engine 1'"]),
        ("engine 0", "generate_group"), ("engine 1'", "generate_group"),  # then the requests
    ]
    assert completions == [["completion"] * 2] * 2 and world.colocation.stale == set()
    # each group carries its prompt's data row, marked an evaluation's (a custom generate function is told)
    assert [args[3:] for _, method, *args in world.log if method == "generate_group"] == [
        [Prompt(1, [1], "a"), True], [Prompt(2, [2], "b"), True]
    ]


def _weights_to(engines: list[str]) -> list[tuple[str, str]]:
    """The calls of the two hand-overs that give `engines` the actor's weights (generate's refresh)."""
    return [
        *((engine, "release_memory_occupation") for engine in engines),
        ("training rank 0", "wake"),
        *((engine, "resume_memory_occupation") for engine in engines),
        ("training rank 0", "push_weights"),
        ("training rank 0", "sleep"),
        *((engine, "resume_memory_occupation") for engine in engines),
    ]


def _sent(log) -> list[tuple[str, list[int], int]]:
    """Each generate_group call logged: (engine, prompt, first seed)."""
    return [(name, prompt, sampling.seed) for name, method, *args in log if method == "generate_group"
            for prompt, sampling, *_ in [args]]


def test_each_group_goes_whole_to_the_engine_with_the_fewest_requests_in_flight(world):
    colocation = Colocation(world.trainers, _Group("engine", 3, world.log), 1, SETTINGS, FaultPlan())
    for key in range(4):
        colocation.submit(key, [key], SamplingConfig(n=2, seed=10 + 2 * key))
    assert _sent(world.log) == [("engine 0", [0], 10), ("engine 1", [1], 12), ("engine 2", [2], 14),
                                ("engine 0", [3], 16)]  # ties to the lowest index
    assert colocation.next_done() == (0, ["completion"] * 2)  # engine 0 has 2 requests in flight again
    world.log.clear()
    colocation.submit(4, [4], SamplingConfig(n=1))  # 2, 2 and 2 in flight: engine 0
    colocation.submit(5, [5], SamplingConfig(n=2))  # 3, 2 and 2: engine 1
    assert [entry[0] for entry in world.log] == ["engine 0", "engine 1"]
    assert [colocation.next_done()[0] for _ in range(5)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("num_prompts, num_engines", [(1, 1), (5, 2), (8, 4), (9, 4), (3, 8)])
def test_most_requests_per_engine_is_what_the_balance_gives_the_busiest_engine(world, num_prompts, num_engines):
    colocation = Colocation(world.trainers, _Group("engine", num_engines, world.log), 1, SETTINGS, FaultPlan())
    for key in range(num_prompts):
        colocation.submit(key, [key], SamplingConfig(n=8))
    per_engine = [sum(1 for entry in world.log if entry[0] == f"engine {i}") * 8 for i in range(num_engines)]
    assert most_requests_per_engine(num_prompts, 8, num_engines) == max(per_engine)


def test_the_groups_of_an_engine_dead_mid_rollout_go_again_with_their_seeds_once_every_engine_has_the_weights(world):
    colocation = world.colocation
    for key in range(3):
        colocation.submit(key, [key], SamplingConfig(n=2, seed=2 * key))  # engines 0, 1, 0
    world.engines.actors[0].fails["generate_group"] = RayActorError("e0" * 16, "The actor died.")
    world.log.clear()
    assert colocation.next_done() == (1, ["completion"] * 2)  # engine 1's group; engine 0's are held
    colocation.submit(3, [3], SamplingConfig(n=2, seed=6))  # held too: the new engine has no weights yet
    assert _sent(world.log) == []
    assert [colocation.next_done()[0] for _ in range(3)] == [0, 2, 3]
    assert [entry[:2] for entry in world.log] == [
        ("restart", "engine 0"), ("engine 0'", "watched_child_pids"),
        # nothing runs any more: the actor's weights to every engine, through the two hand-overs
        *_weights_to(["engine 0'", "engine 1"]),
        ("engine 0'", "generate_group"), ("engine 1", "generate_group"), ("engine 0'", "generate_group"),
    ]
    assert _sent(world.log) == [("engine 0'", [0], 0), ("engine 1", [2], 4), ("engine 0'", [3], 6)]
    assert colocation.stale == set()


def test_calls_done_together_are_taken_with_one_wait_and_those_lost_with_a_restarted_engine_go_again(
    world, monkeypatch
):
    waits = []

    def first_done(refs, *args):
        waits.append(len(refs))
        return refs[0]

    def get(ref):  # engine 0's calls end with its death, found at ray.get of the first one
        if ref.actor.name == "engine 0":
            raise RayActorError("e0" * 16, "The actor died.")
        return _answer(ref)

    monkeypatch.setattr(relax.run.colocation, "first_done", first_done)
    monkeypatch.setattr(relax.run.colocation.ray, "get", get)
    colocation = world.colocation
    for key in range(3):
        colocation.submit(key, [key], SamplingConfig(n=2, seed=2 * key))  # engines 0, 1, 0: every call done
    assert colocation.next_done() == (1, ["completion"] * 2)  # group 0 met engine 0's death: 0 and 2 held
    assert waits == [3]  # group 1 was seen done in the same wait
    world.log.clear()
    assert [colocation.next_done()[0] for _ in range(2)] == [0, 2]  # not group 2's call on the dead engine
    assert waits == [3, 2]
    assert _sent(world.log) == [("engine 0'", [0], 0), ("engine 1", [2], 4)]


def test_continued_responses_count_one_request_each_and_go_again_with_their_prefixes_after_an_engine_death(world):
    colocation = world.colocation
    colocation.submit(0, [0], SamplingConfig(n=4), prefixes=[[5], [6, 7]])  # 2 requests: engine 0
    colocation.submit(1, [1], SamplingConfig(n=4))  # 4 requests: engine 1
    colocation.submit(2, [2], SamplingConfig(n=1))  # engine 0 has fewer requests in flight (2 against 4)
    assert [entry[0] for entry in world.log] == ["engine 0", "engine 1", "engine 0"]
    world.engines.actors[0].fails["generate_group"] = RayActorError("e0" * 16, "The actor died.")
    assert colocation.next_done() == (1, ["completion"] * 4)
    world.log.clear()
    assert [colocation.next_done() for _ in range(2)] == [(0, ["completion"] * 2), (2, ["completion"])]
    continued = [args for name, method, *args in world.log if method == "generate_group"]
    assert continued[0][0] == [0] and continued[0][2] == [[5], [6, 7]]  # sent again with its prefixes
    colocation.submit(3, [3], SamplingConfig(n=4), prefixes=[[8]])
    colocation.stale = {0}  # held (a restarted engine waits for the weights), then aborted: one per request
    colocation.submit(4, [4], SamplingConfig(n=4), prefixes=[[8], [9]])
    colocation.abort()
    assert sorted((key, len(completions)) for key, completions in (colocation.next_done() for _ in range(2))) == [
        (3, 1), (4, 2)
    ]


def test_an_abort_ends_every_engines_groups_and_returns_the_held_ones_aborted(world):
    colocation = world.colocation
    colocation.stale = {1}  # a restarted engine: the groups wait for the weights
    colocation.submit(0, [0], SamplingConfig(n=2))
    colocation.abort()
    assert [entry[:2] for entry in world.log] == [("engine 0", "abort_requests"), ("engine 1", "abort_requests")]
    key, completions = colocation.next_done()
    assert key == 0 and [c.finish_reason for c in completions] == ["abort", "abort"]
    assert not any(c.token_ids for c in completions)


def test_an_engine_dead_at_the_abort_is_restarted_once_and_its_groups_come_back_aborted(world):
    colocation = world.colocation
    for key in range(2):
        colocation.submit(key, [key], SamplingConfig(n=2))  # engines 0 and 1
    world.engines.actors[1].fails["abort_requests"] = RayActorError("e1" * 16, "The actor died.")
    colocation.abort()  # engine 1 restarted, and called again
    key, completions = colocation.next_done()
    assert key == 1 and [c.finish_reason for c in completions] == ["abort", "abort"]
    assert colocation.next_done() == (0, ["completion"] * 2)
    assert [entry for entry in world.log if entry[0] == "restart"] == [("restart", "engine 1")]
    assert [entry[:2] for entry in world.log][-2:] == [("engine 1'", "watched_child_pids"),
                                                      ("engine 1'", "abort_requests")]  # the call it missed


def test_the_injected_faults_are_read_from_the_environment_and_each_is_done_once():
    plan = FaultPlan.from_environ({"RELAX_INJECT_FAULTS": "push@1=engine, release@0=scheduler,save@1=rank"})
    assert plan.take("release") == "scheduler" and plan.take("release") is None  # step 0's, once
    assert plan.take("push") is None  # step 1's
    plan.at(1)
    assert (plan.take("save"), plan.take("push"), plan.take("push")) == ("rank", "engine", None)
    assert FaultPlan.from_environ({}).due == set()
    with pytest.raises(ValueError, match=r"RELAX_INJECT_FAULTS: 'push@one=engine' is not phase@step=victim"):
        FaultPlan.from_environ({"RELAX_INJECT_FAULTS": "push@one=engine"})
    with pytest.raises(ValueError, match="'train@1=rank'"):
        FaultPlan.from_environ({"RELAX_INJECT_FAULTS": "train@1=rank"})


def _beside_training(world) -> list:
    """world.colocation as relax.run.loop_async drives it; the calls of its refresh_weights are logged."""
    def refresh_weights():
        world.log.append(("loop", "refresh_weights"))
        world.colocation.push(inject_faults=False)

    world.colocation.beside_training(refresh_weights)
    return world.log


def test_beside_the_training_the_groups_of_a_dead_engine_go_at_once_to_the_engines_not_restarted(world):
    colocation, log = world.colocation, _beside_training(world)
    for key in range(3):
        colocation.submit(key, [key], SamplingConfig(n=2, seed=2 * key))  # engines 0, 1, 0
    world.engines.actors[0].fails["generate_group"] = RayActorError("e0" * 16, "The actor died.")
    log.clear()
    assert colocation.next_done() == (0, ["completion"] * 2)  # engine 0's first group, sent again to engine 1
    colocation.submit(3, [3], SamplingConfig(n=2, seed=6))  # not held: engine 1 still has the weights
    assert [colocation.next_done()[0] for _ in range(3)] == [1, 2, 3]
    assert [entry[:2] for entry in log] == [
        ("restart", "engine 0"), ("engine 0'", "watched_child_pids"),
        ("engine 1", "generate_group"), ("engine 1", "generate_group"),  # engine 0's, with their seeds, at once
        ("engine 1", "generate_group"),
    ]
    assert _sent(log) == [("engine 1", [0], 0), ("engine 1", [2], 4), ("engine 1", [3], 6)]
    assert colocation.stale == {0} and not colocation.actor_awake  # it idles until the step's push
    colocation.push()
    assert colocation.stale == set() and [entry[:2] for entry in log][-1] == ("training rank 0", "push_weights")


def test_beside_the_training_once_every_engine_was_restarted_the_groups_wait_for_refresh_weights(world):
    colocation, log = world.colocation, _beside_training(world)
    for key in range(2):
        colocation.submit(key, [key], SamplingConfig(n=2, seed=2 * key))  # engines 0 and 1
    for engine in (0, 1):
        world.engines.actors[engine].fails["generate_group"] = RayActorError(f"e{engine}" * 16, "The actor died.")
    log.clear()
    assert [colocation.next_done()[0] for _ in range(2)] == [0, 1]
    assert [entry[:2] for entry in log] == [
        ("restart", "engine 0"), ("engine 0'", "watched_child_pids"),
        ("engine 1", "generate_group"),  # engine 1 still has the weights: engine 0's group goes there, and fails
        ("restart", "engine 1"), ("engine 1'", "watched_child_pids"),
        ("loop", "refresh_weights"), ("training rank 0", "push_weights"),  # no sleep or hand-over: the actor's weights
        ("engine 0'", "generate_group"), ("engine 1'", "generate_group"),
    ]
    assert _sent(log)[-2:] == [("engine 0'", [0], 0), ("engine 1'", [1], 2)] and colocation.stale == set()
    pushes = [args for name, method, *args in log if method == "push_weights"]
    assert pushes == [[world.engines.actors, 1, ["node", "node"], None, False]]  # engines_apart: the push's route
    assert colocation.take_faults()["faults/engine_restarts"] == 2
