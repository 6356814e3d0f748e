"""relax.ray.placement: bundle order and the variables each placed actor gets (no Ray cluster needed)."""

import os
from types import SimpleNamespace

import pytest

from relax.ray.placement import (
    ENGINE_DEVICES_ENV,
    LOCAL_DEVICE_ENV,
    Bundle,
    Placement,
    _base_env,
    _resource_options,
    bundle_resources_for,
    bundle_sort_key,
    engine_envs,
    local_device_index,
    node_layout_problem,
    noset_visible_devices_env,
    placement_plan,
    training_envs,
)
from relax.ray.runtime_env import forwarded_env

def fake_platform(ray_resource, visible_devices_env):
    """Stands in for a relax.platform record: the Ray facts and the worker-environment calls."""
    return SimpleNamespace(ray_resource=ray_resource, visible_devices_env=visible_devices_env,
                           worker_env=lambda memory_saver_on: {"PLATFORM_DEFAULT": "1"},
                           check_worker_env=lambda env, memory_saver_on: None)


NPU = fake_platform("NPU", "ASCEND_RT_VISIBLE_DEVICES")
CPU = fake_platform(None, None)


def bundle(index, ip, node, device=None, local=None):
    return Bundle(index=index, node_id=node, node_ip=ip, device_id=device, local_device=local)


def placement(platform, bundles):
    return Placement(platform=platform, group=None, bundle_resources={}, bundles=bundles,
                     master_addr=bundles[0].node_ip, master_port=29500)


def test_bundles_sort_by_node_address_numerically_then_node_id_then_device_numerically():
    unsorted = [
        bundle(0, "10.0.0.10", "a", "0"), bundle(1, "10.0.0.9", "z", "10"), bundle(2, "10.0.0.9", "z", "2"),
        bundle(3, "10.0.0.9", "b", "1"), bundle(4, "node-x.local", "c", "0"), bundle(5, "10.0.0.9", "b", "0"),
    ]
    order = [b.index for b in sorted(unsorted, key=bundle_sort_key)]
    assert order == [5, 3, 2, 1, 0, 4]


def test_cpu_bundles_keep_their_index_order_within_a_node():
    unsorted = [bundle(0, "10.0.0.2", "n2"), bundle(1, "10.0.0.1", "n1"), bundle(2, "10.0.0.2", "n2")]
    assert [b.index for b in sorted(unsorted, key=bundle_sort_key)] == [1, 0, 2]


def test_bundle_resources_and_ray_options_per_platform():
    assert bundle_resources_for(NPU, 2) == {"NPU": 1, "CPU": 2}
    assert bundle_resources_for(CPU, 3) == {"CPU": 3}
    assert _resource_options({"NPU": 0.4, "CPU": 0.8}) == {"num_cpus": 0.8, "num_gpus": 0, "resources": {"NPU": 0.4}}
    assert _resource_options({"GPU": 0.2, "CPU": 0.2}) == {"num_cpus": 0.2, "num_gpus": 0.2}
    assert noset_visible_devices_env(NPU) == {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"}
    assert noset_visible_devices_env(CPU) == {}


def test_training_ranks_get_torch_distributed_variables_and_their_logical_device():
    placed = placement(NPU, [bundle(3, "10.0.0.1", "a", "4", 0), bundle(0, "10.0.0.1", "a", "5", 1),
                             bundle(1, "10.0.0.2", "b", "0", 0), bundle(2, "10.0.0.2", "b", "1", 1)])
    envs = training_envs(placed, {"BASE": "1"})
    assert envs[2] == {"BASE": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "2",
                       "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", LOCAL_DEVICE_ENV: "0"}
    assert [(env["RANK"], env["LOCAL_RANK"], env[LOCAL_DEVICE_ENV]) for env in envs] == [
        ("0", "0", "0"), ("1", "1", "1"), ("2", "0", "0"), ("3", "1", "1")]
    assert local_device_index(envs[1]) == 1 and local_device_index({}) == 0


def test_cpu_ranks_and_engines_get_no_device_variables():
    placed = placement(CPU, [bundle(0, "10.0.0.1", "a"), bundle(1, "10.0.0.1", "a")])
    assert LOCAL_DEVICE_ENV not in training_envs(placed, {})[1]
    (engine,) = engine_envs(placed, 2, {})
    assert engine == {"RELAX_ENGINE_RANK": "0", "RELAX_NUM_ENGINES": "1"}


def test_engines_take_consecutive_devices_of_one_node():
    placed = placement(NPU, [bundle(i, "10.0.0.1", "a", str(i + 2), i) for i in range(4)])
    envs = engine_envs(placed, 2, {})
    assert [(env["RELAX_ENGINE_RANK"], env[LOCAL_DEVICE_ENV], env[ENGINE_DEVICES_ENV]) for env in envs] == [
        ("0", "0", "0,1"), ("1", "2", "2,3")]


def test_engines_apart_take_the_bundles_after_the_actors_with_their_own_devices_and_environment():
    """--no-colocate: one placement, the training ranks on its first bundles and the engines on the rest
    (Placement.part), each part numbered from its own first bundle."""
    placed = placement(NPU, [bundle(i, "10.0.0.1", "a", str(i), i) for i in range(6)])
    actor, engines = placed.part(0, 2), placed.part(2, 6)
    assert [env["RANK"] for env in training_envs(actor, {})] == ["0", "1"]
    assert training_envs(actor, {})[0]["WORLD_SIZE"] == "2" and actor.master_port == placed.master_port
    assert [(env["RELAX_ENGINE_RANK"], env[ENGINE_DEVICES_ENV]) for env in engine_envs(engines, 2, {})] == [
        ("0", "2,3"), ("1", "4,5")]
    assert engines.groups is placed.groups  # a wait on either part's actors watches both


def test_the_dry_run_shows_which_bundles_each_side_takes():
    assert placement_plan(1, 2, 2, engine_devices=4) == [
        "placement: 6 bundle(s) (the actor's, then the engines')",
        "  training ranks 0-1: bundles 0-1 (1 node(s) x 2)",
        "  engine 0: bundles 2-3",
        "  engine 1: bundles 4-5",
    ]
    assert placement_plan(2, 2, 2, engine_devices=None) == [
        "placement: 4 bundle(s) (shared by the actor and the engines)",
        "  training ranks 0-3: bundles 0-3 (2 node(s) x 2)",
        "  engine 0: bundles 0-1",
        "  engine 1: bundles 2-3",
    ]
    assert placement_plan(1, 2, 1, engine_devices=0) == [  # --no-colocate --rollout-num-devices 0
        "placement: 2 bundle(s) (the actor and the engines side by side)",
        "  training ranks 0-1: bundles 0-1 (1 node(s) x 2)",
        "  engine 0: bundles 0-0",
        "  engine 1: bundles 1-1",
    ]
    assert placement_plan(1, 1, 1, engine_devices=None, with_engines=False) == [
        "placement: 1 bundle(s) (shared by the actor and the engines)",
        "  training ranks 0-0: bundles 0-0 (1 node(s) x 1)",
    ]


def test_engine_layouts_that_cannot_work_are_refused_with_the_reason():
    two_nodes = placement(NPU, [bundle(0, "10.0.0.1", "a", "0", 0), bundle(1, "10.0.0.1", "a", "1", 1),
                                bundle(2, "10.0.0.2", "b", "0", 0), bundle(3, "10.0.0.2", "b", "1", 1)])
    with pytest.raises(ValueError, match="must divide the 4 placed devices"):
        engine_envs(two_nodes, 3, {})
    with pytest.raises(ValueError, match="engine 0 would span nodes"):
        engine_envs(two_nodes, 4, {})
    gap = placement(NPU, [bundle(0, "10.0.0.1", "a", "0", 0), bundle(1, "10.0.0.1", "a", "2", 2)])
    with pytest.raises(ValueError, match=r"engine 0 got devices \[0, 2\] on node 10.0.0.1, not consecutive"):
        engine_envs(gap, 2, {})


def test_placed_actors_get_the_run_environment_but_not_the_creators_own_placement(monkeypatch):
    for name in forwarded_env(os.environ):  # only the variables set here
        monkeypatch.delenv(name)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "600")
    monkeypatch.setenv(LOCAL_DEVICE_ENV, "5")  # as inside an actor that was itself placed
    monkeypatch.setenv("RELAX_ENGINE_RANK", "3")
    placed = placement(NPU, [bundle(0, "10.0.0.1", "a", "0", 0)])
    assert _base_env(placed, {"MINE": "x"}, memory_saver_on=False) == {
        "PLATFORM_DEFAULT": "1", "HCCL_EXEC_TIMEOUT": "600", "MINE": "x",
        "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1",
    }


class _FakeGroup:
    """Stands in for an ActorGroup: its actors' ids and how it names them."""

    def __init__(self, role: str, actor_ids: list[str]):
        self.role = role
        self.actors = [SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda value=value: value)) for value in actor_ids]

    def describe(self, index: int) -> str:
        return f"{self.role} {index} (pid 4{index})"


def _task_error(actor_id: str, cause: Exception, traceback_tail: str = ""):
    """What ray.get raises when an actor method raised `cause`."""
    from ray.exceptions import RayTaskError

    traceback_str = f"Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n{traceback_tail}{cause!r}"
    return RayTaskError("method", traceback_str, cause, proctitle="ray::Worker.method", pid=41, ip="10.0.0.1",
                        actor_repr="<Worker>", actor_id=actor_id).as_instanceof_cause()


def test_worker_failure_names_the_actor_an_error_came_from():
    from ray.exceptions import RayActorError

    from relax.ray.placement import WorkerFailed, worker_failure

    trainers = _FakeGroup("training rank", ["a0" * 16, "a1" * 16])
    engines = _FakeGroup("engine", ["e0" * 16])

    died = worker_failure(RayActorError("a1" * 16, "The actor died unexpectedly."), [trainers, engines, None])
    assert isinstance(died, WorkerFailed)
    assert str(died) == "training rank 1 (pid 41) failed: The actor died unexpectedly."

    raised = worker_failure(_task_error("e0" * 16, RuntimeError("its scheduler is gone")), [trainers, engines])
    assert str(raised) == "engine 0 (pid 40) failed: RuntimeError: its scheduler is gone"

    # A rank's own error that mentions an engine: the rank raised it (its id comes first in the text).
    mentions = _task_error("a0" * 16, RuntimeError(f"engine actor {'e0' * 16} was slow"))
    assert str(worker_failure(mentions, [engines, trainers])).startswith("training rank 0 (pid 40) failed: ")

    # A rank's call on an engine that died or raised: Ray relays the engine's error; the engine is named.
    relayed = worker_failure(_task_error("a0" * 16, RayActorError("e0" * 16, "The actor died.")), [trainers, engines])
    assert str(relayed) == "engine 0 (pid 40) failed: The actor died."
    engine_raised = _task_error("e0" * 16, RuntimeError("its scheduler is gone"))
    relayed = worker_failure(_task_error("a0" * 16, engine_raised), [trainers, engines])
    assert str(relayed) == "engine 0 (pid 40) failed: RuntimeError: its scheduler is gone"
    # A rank that re-raises the engine's error after its other calls (the push): Ray keeps only the engine's
    # exception as the cause; the engine's header comes last in the traceback.
    engine_header = f"ray::EngineWorker.end_weight_update() (pid=42, ip=10.0.0.1, actor_id={'e0' * 16})\n"
    reraised = _task_error("a0" * 16, RuntimeError("its scheduler is gone"), traceback_tail=engine_header)
    assert str(worker_failure(reraised, [trainers, engines])) == (
        "engine 0 (pid 40) failed: RuntimeError: its scheduler is gone"
    )

    unknown = RayActorError("ff" * 16, "someone else's actor")
    assert worker_failure(unknown, [trainers, engines]) is unknown


def test_node_layout_problem_accepts_the_asked_layout_and_names_a_packed_one():
    spread = [bundle(0, "10.0.0.1", "node-a"), bundle(1, "10.0.0.2", "node-b")]
    assert node_layout_problem(spread, num_nodes=2, devices_per_node=1) is None
    packed = [bundle(i, "10.0.0.1", "node-a") for i in range(4)]
    problem = node_layout_problem(packed, num_nodes=2, devices_per_node=2)
    assert "--num-nodes 2 --num-devices-per-node 2" in problem and "4 on node node-a" in problem
    uneven = [*packed[:3], bundle(3, "10.0.0.2", "node-b")]
    assert "3 on node node-a, 1 on node node-b" in node_layout_problem(uneven, num_nodes=2, devices_per_node=2)
