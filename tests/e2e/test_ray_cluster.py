"""relax.ray on a real two-node Ray cluster on this machine (two raylets with their own node ids), started once
(two_node_cluster, tests/e2e/conftest.py).

Both nodes declare 2 GPUs to Ray (no GPU is needed for that: Ray only counts them), the second with the
raylet's CUDA_VISIBLE_DEVICES=2,3 as on a node where devices 0 and 1 are taken, so Ray's physical ids differ
from the logical ones there. Each node also has a custom resource naming it. The same cluster then takes a
job from `relax submit` (through scripts/submit.sh) whose variables exist only in the submitting shell.

The liveness watch (relax.ray.watch, wait_for in relax.ray.placement) on the same cluster: while the driver waits
on one group's slow calls, an actor of another group (one with no call pending, so only the watch can notice) or
a child process an actor depends on is killed, and the wait fails at once, naming the actor, its pid, node and log.
A call that does not answer within its Timeout fails naming the actor it was called on. Engines restarted in place
(relax.run.colocation) on these actors: a share whose engine's child dies is answered by the new actor. The bound
on each wait is a hang guard (the slow calls take 60 s; a wait that ends well before them ended because of the
death), not a timing test.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from relax.platform import platform_facts
from relax.ray.envcheck import REPORT_PREFIX, EnvReporter
from relax.ray.faults import FaultPlan
from relax.ray.runtime_env import WORKER_ENV_NAMES
from relax.ray.placement import (
    ENGINE_DEVICES_ENV,
    ENGINE_RANK_ENV,
    LOCAL_DEVICE_ENV,
    NUM_ENGINES_ENV,
    WorkerFailed,
    create_engine_actors,
    create_placement,
    create_training_actors,
    engine_envs,
    wait_for,
)
from relax.ray.watch import Timeout
from relax.rollout.data import Prompt
from relax.rollout.engine import Completion, SamplingConfig
from relax.run.colocation import Colocation

REPO = Path(__file__).resolve().parents[2]

WATCHED = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           LOCAL_DEVICE_ENV, ENGINE_RANK_ENV, NUM_ENGINES_ENV, ENGINE_DEVICES_ENV,
           "RELAX_TEST_CALLER_VAR"]


class RankProbe(EnvReporter):
    """A training rank that also joins torch.distributed from the variables its placement gave it."""

    def all_reduce_rank(self, backend: str) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group(backend)  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
        try:
            value = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(value)
            return value.item()
        finally:
            dist.destroy_process_group()




def test_two_cpu_devices_colocate_two_ranks_and_one_engine(two_node_cluster):
    cpu = platform_facts("cpu")
    placement = create_placement(cpu, num_devices=2, strategy="STRICT_PACK")
    ranks = create_training_actors(RankProbe, placement, env={"RELAX_TEST_CALLER_VAR": "ranks"})
    engines = create_engine_actors(EnvReporter, placement, devices_per_engine=2, env={"RELAX_TEST_CALLER_VAR": "engine"})
    try:
        assert placement.bundle_resources == {"CPU": 1}
        assert [bundle.device_id for bundle in placement.bundles] == [None, None]
        rank_reports = ray.get(ranks.call("report", WATCHED))
        (engine_report,) = ray.get(engines.call("report", WATCHED))
        node = placement.bundles[0].node_id
        for rank, report in enumerate(rank_reports):
            assert report["node_id"] == node
            assert report["env"] == {
                **dict.fromkeys(WATCHED),
                "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": placement.master_addr, "MASTER_PORT": str(placement.master_port),
                "RELAX_TEST_CALLER_VAR": "ranks",
            }
        assert engine_report["node_id"] == node
        assert engine_report["env"] == {
            **dict.fromkeys(WATCHED), ENGINE_RANK_ENV: "0", NUM_ENGINES_ENV: "1", "RELAX_TEST_CALLER_VAR": "engine",
        }
        # 0.4 (rank) + 0.2 (engine) of bundle 0 and 0.4 of bundle 1 are taken: 1.0 CPU of the 2 reserved.
        group_cpus = {name: amount for name, amount in ray.available_resources().items()
                      if name.startswith("CPU_group_") and placement.group.id.hex() in name}
        assert sorted(group_cpus.values()) == pytest.approx([0.4, 0.6, 1.0])
        # The variables are all torch.distributed needs: the two ranks form a group and reduce 1 + 2.
        assert ray.get(ranks.call("all_reduce_rank", cpu.dist_backend)) == [3.0, 3.0]
    finally:
        engines.kill()
        ranks.kill()
        placement.remove()


def test_devices_on_two_nodes_ordered_by_node_then_device(two_node_cluster, monkeypatch):
    # The CUDA record (its facts only: nothing here computes on a GPU); Ray hands out its counted GPUs.
    gpu_platform = platform_facts("cuda")
    # The driver's own value of a default would win over it (the user's shell overrides platform defaults);
    # an SGLang engine started earlier in this process sets CUDA_DEVICE_MAX_CONNECTIONS=8 in os.environ.
    for name in gpu_platform.worker_env():
        monkeypatch.delenv(name, raising=False)
    placement = create_placement(gpu_platform, num_devices=4)
    ranks = create_training_actors(EnvReporter, placement)
    engines = create_engine_actors(EnvReporter, placement, devices_per_engine=2)
    defaults = gpu_platform.worker_env()  # the platform's worker defaults reach every placed actor
    watched = WATCHED + ["CUDA_VISIBLE_DEVICES", *defaults]
    try:
        bundles = placement.bundles
        nodes = placement.node_ids()
        assert len(nodes) == 2 and nodes == sorted(nodes)
        assert [bundle.node_id for bundle in bundles] == [nodes[0], nodes[0], nodes[1], nodes[1]]
        physical = {name: [] for name in two_node_cluster.node_names.values()}
        for bundle in bundles:
            physical[two_node_cluster.node_names[bundle.node_id]].append(bundle.device_id)
        assert physical == {"relax_test_node_a": ["0", "1"], "relax_test_node_b": ["2", "3"]}
        assert [bundle.local_device for bundle in bundles] == [0, 1, 0, 1]
        assert placement.master_addr == bundles[0].node_ip

        raylet_visible = {"relax_test_node_a": None, "relax_test_node_b": "2,3"}
        for rank, (bundle, report) in enumerate(zip(bundles, ray.get(ranks.call("report", watched)))):
            assert report["node_id"] == bundle.node_id
            assert report["accelerator_ids"] == {"GPU": [bundle.device_id]}
            env = report["env"]
            assert {name: env[name] for name in defaults} == defaults
            assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(rank), "4", str(rank % 2))
            assert env[LOCAL_DEVICE_ENV] == str(bundle.local_device)
            # Ray was told not to narrow CUDA_VISIBLE_DEVICES: the actor sees the raylet's list.
            assert env["CUDA_VISIBLE_DEVICES"] == raylet_visible[two_node_cluster.node_names[bundle.node_id]]

        engine_reports = ray.get(engines.call("report", watched))
        for engine, report in enumerate(engine_reports):
            first = bundles[2 * engine]
            assert report["node_id"] == first.node_id
            assert report["accelerator_ids"] == {"GPU": [first.device_id]}
            assert {name: report["env"][name] for name in defaults} == defaults
            assert report["env"][ENGINE_RANK_ENV] == str(engine)
            assert report["env"][NUM_ENGINES_ENV] == "2"
            assert report["env"][ENGINE_DEVICES_ENV] == "0,1"
            assert report["env"][LOCAL_DEVICE_ENV] == "0"

        with pytest.raises(ValueError, match="engine 0 would span nodes"):
            engine_envs(placement, devices_per_engine=4, base_env={})
    finally:
        engines.kill()
        ranks.kill()
        placement.remove()


def test_variables_forwarded_by_name_reach_every_training_rank_and_engine(two_node_cluster, monkeypatch):
    """Variables that workers read and that share no forwarded prefix (TASK_QUEUE_ENABLE, STREAMS_PER_DEVICE,
    TMS_HOOK_MODE, ...) reach the actors the driver places, as a pre-started cluster's raylets never had them."""
    values = {name: f"value-of-{name.lower()}" for name in WORKER_ENV_NAMES}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    placement = create_placement(platform_facts("cpu"), num_devices=2)
    ranks = create_training_actors(EnvReporter, placement)
    engines = create_engine_actors(EnvReporter, placement, devices_per_engine=1)
    try:
        for group in (ranks, engines):
            for report in ray.get(group.call("report", list(values))):
                assert report["env"] == values
    finally:
        engines.kill()
        ranks.kill()
        placement.remove()


def test_submit_forwards_the_submitting_shell_to_driver_and_actors(two_node_cluster, tmp_path):
    working_dir = tmp_path / "work"
    working_dir.mkdir()
    report_path = tmp_path / "report.json"
    shell = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
    # A stale RAY_ADDRESS in the shell (nothing listens there) must not override --address.
    shell.update(two_node_cluster.local.client_env, RAY_ADDRESS="127.0.0.1:1", RELAX_PYTHON=sys.executable,
                 RELAX_DEVICE="cpu",
                 RELAX_TEST_EXPORTED="from-the-shell", SGLANG_TEST_EXPORTED="sglang-prefixed",
                 MY_TEST_NAMED="named-from-shell")
    names = ["RELAX_TEST_EXPORTED", "SGLANG_TEST_EXPORTED", "MY_TEST_NAMED", "MY_TEST_SET"]
    envcheck = shlex.join([sys.executable, "-m", "relax.ray.envcheck", *names, "--output", str(report_path)])
    # envcheck exits 1 when a variable is missing anywhere; the job's own exit 3 then shows that it passed
    # and that the job's exit code comes back through relax submit.
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "submit.sh"), "--address", two_node_cluster.local.dashboard_url,
         "--env", "MY_TEST_NAMED", "--env", "MY_TEST_SET=set-on-the-command-line", "--working-dir", str(working_dir),
         "--", "bash", "-c", f"{envcheck} && exit 3"],
        env=shell, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "FAILED (exit 3)" in result.stderr
    streamed = [line for line in result.stdout.splitlines() if line.startswith(REPORT_PREFIX)]
    assert len(streamed) == 1, result.stdout  # the job's logs were streamed back
    report = json.loads(report_path.read_text())
    assert json.loads(streamed[0][len(REPORT_PREFIX):]) == report

    processes = [report["driver"], report["plain_actor"], *report["placed_ranks"]]
    assert len({entry["pid"] for entry in processes}) == 3  # the driver, a plain actor, a placed rank
    for entry in processes:
        assert entry["env"] == {
            "RELAX_TEST_EXPORTED": "from-the-shell",
            "SGLANG_TEST_EXPORTED": "sglang-prefixed",
            "MY_TEST_NAMED": "named-from-shell",
            "MY_TEST_SET": "set-on-the-command-line",
        }


# The liveness watch and engines restarted in place (the module doc's second part).

SLOW_CALL_S = 60
HANG_GUARD_S = 30


class Sleeper:
    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def fail(self):
        raise ValueError("this call fails")


class ChildKeeper(Sleeper):
    """Like EngineWorker with SGLang's scheduler: a child process it cannot work without."""

    def __init__(self):
        # The child ends when this actor does (it polls for its parent), so a killed actor leaves none.
        self.child = subprocess.Popen([sys.executable, "-c", (
            "import os, time\nparent = os.getppid()\nwhile os.getppid() == parent:\n    time.sleep(0.2)"
        )])

    def watched_child_pids(self) -> list[int]:
        return [self.child.pid]


class SlowEngine(ChildKeeper):
    """Answers a generate call as an engine does (n completions per prompt, the request's seed as its one token),
    slowly enough to be killed mid-call; which process answered is in the text."""

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        time.sleep(3)
        seeds = iter(range(sampling.seed, sampling.seed + len(prompts) * sampling.n))
        pid = str(os.getpid())
        return [[Completion([next(seeds)], [0.0], "stop", pid) for _ in range(sampling.n)] for _ in prompts]

    def generate_group(self, prompt: list[int], sampling: SamplingConfig, prefixes=None, source=None,
                       evaluation=False) -> list[Completion]:
        assert prefixes is None, "nothing is continued without --partial-rollout"
        return self.generate([prompt], sampling)[0]


class DiesInInit:
    def __init__(self):
        os._exit(1)




# Workers cannot import this test module: Ray ships its classes (RankProbe, Sleeper, ...) by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def placement(two_node_cluster):
    """One CPU bundle on each of the two nodes; the groups made on it are killed afterwards."""
    placement = create_placement(platform_facts("cpu"), num_devices=2, strategy="STRICT_SPREAD")
    yield placement
    for group in list(placement.groups):
        group.kill()
    placement.remove()


def _kill_soon(pid: int, delay_s: float = 2.0) -> None:
    """SIGKILL `pid` a moment from now, while the test's driver waits."""
    threading.Timer(delay_s, os.kill, (pid, signal.SIGKILL)).start()


def _waited_failure(refs, placement) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as failure:
        wait_for(refs, placement)
    waited = time.monotonic() - start
    print(f"after {waited:.1f} s: {failure.value}")
    return str(failure.value), waited


def test_wait_returns_the_results_and_raises_a_failed_call_as_ray_get_does(placement):
    ranks = create_training_actors(Sleeper, placement)
    assert wait_for(ranks.call("sleep", 0.1), placement) == [0.1, 0.1]
    assert ranks.run("sleep", 0.1) == [0.1, 0.1]  # the same, through the group
    with pytest.raises(ray.exceptions.RayTaskError, match="this call fails"):
        wait_for(ranks.call("fail"), placement)


def test_an_actor_of_an_idle_group_killed_during_another_groups_call_fails_the_wait_naming_it(placement):
    ranks = create_training_actors(Sleeper, placement)
    engines = create_engine_actors(Sleeper, placement, devices_per_engine=1)
    pids = wait_for(engines.call("pid"), placement)
    _kill_soon(pids[1])  # engine 1 runs on the second node
    message, waited = _waited_failure(ranks.call("sleep", SLOW_CALL_S), placement)
    assert waited < HANG_GUARD_S, f"the wait ended {waited:.0f} s after it began: {message}"
    assert message.startswith(f"engine 1 (Sleeper, pid {pids[1]} on "), message
    assert f"failed: its process (pid {pids[1]}) exited" in message, message
    assert "log: " in message and ".err" in message, message


def test_a_dead_child_process_of_an_actor_fails_the_wait_naming_the_actor_and_the_process(placement):
    ranks = create_training_actors(Sleeper, placement)
    engines = create_engine_actors(ChildKeeper, placement, devices_per_engine=1)
    actor_pids = wait_for(engines.call("pid"), placement)
    (child_pid,) = ray.get(engines.actors[0].watched_child_pids.remote())
    _kill_soon(child_pid)
    message, waited = _waited_failure(ranks.call("sleep", SLOW_CALL_S), placement)
    assert waited < HANG_GUARD_S, f"the wait ended {waited:.0f} s after it began: {message}"
    assert message.startswith(f"engine 0 (ChildKeeper, pid {actor_pids[0]} on "), message
    assert "failed: its process '" in message and f"(pid {child_pid}) exited" in message, message


def test_an_actor_that_dies_in_its_init_fails_the_wait_naming_it(placement):
    """The call waited on never ends on its own: only the engine's death ends the wait. The bound is a hang guard
    alone: Ray starts the actor's process when the machine lets it, which on CI's two busy cores took up to 150 s."""
    ranks = create_training_actors(Sleeper, placement)
    create_engine_actors(DiesInInit, placement, devices_per_engine=1)
    message, waited = _waited_failure(ranks.call("sleep", 3600), placement)
    assert waited < 300, f"the wait ended {waited:.0f} s after it began: {message}"
    assert re.match(r"engine [01] \(DiesInInit, actor id \w+\) failed: ", message), message
    assert "died" in message, message


def test_kill_ends_the_watchers_too(placement):
    ranks = create_training_actors(Sleeper, placement)
    watches = ranks.watch()
    assert len(watches) == 2  # one watcher per node
    ranks.kill()
    ended, _ = ray.wait(watches, num_returns=len(watches), timeout=HANG_GUARD_S)
    assert len(ended) == len(watches)
    for watch in watches:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(watch)
    assert placement.groups == []


def test_a_call_that_does_not_answer_in_time_fails_naming_the_actor_and_the_setting(placement):
    ranks = create_training_actors(Sleeper, placement)
    pids = wait_for(ranks.call("pid"), placement)
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as failure:
        ranks.run("sleep", SLOW_CALL_S, timeout=Timeout(2, "--some-timeout"))
    assert time.monotonic() - start < HANG_GUARD_S
    message = str(failure.value)
    assert message.startswith(f"training rank 0 (Sleeper, pid {pids[0]} on "), message
    assert "did not answer within 2 s (--some-timeout; raise it" in message, message
    assert (failure.value.group, failure.value.index) == (ranks, 0)


def _restarting(engines, max_restarts: int) -> Colocation:
    """The engines without a training actor (as under --debug-rollout-only)."""
    settings = SimpleNamespace(
        max_engine_restarts=max_restarts,
        engine_start_timeout=Timeout(HANG_GUARD_S, "--engine-start-timeout"),
        rollout_timeout=Timeout(HANG_GUARD_S, "--rollout-timeout"),
        weight_sync_timeout=Timeout(HANG_GUARD_S, "--weight-sync-timeout"),
    )
    return Colocation(None, engines, 1, settings, FaultPlan())


def _prompts(count: int) -> list[Prompt]:
    """Prompts [1], [2], ... as the evaluation's generate takes them."""
    return [Prompt(row, [row], f"p{row}") for row in range(1, count + 1)]


def test_an_engine_whose_child_dies_mid_generate_is_restarted_in_place_and_its_groups_sent_again(placement):
    engines = create_engine_actors(SlowEngine, placement, devices_per_engine=1)
    old_pids = wait_for(engines.call("pid"), placement)
    (child_pid,) = ray.get(engines.actors[1].watched_child_pids.remote())
    colocation = _restarting(engines, max_restarts=1)
    generate = colocation.generate
    _kill_soon(child_pid, delay_s=1.0)  # engine 1's, while both engines generate
    sampling = SamplingConfig(n=2, seed=100)
    completions = generate(_prompts(4), sampling)
    # Every request answered once, with its own seed, in prompt order; the groups engine 1 held were sent again
    # (to whichever engine had the least in flight: engine 0 or the new actor), none answered by the dead one.
    seeds = [[c.token_ids[0] for c in group] for group in completions]
    assert seeds == [[100, 101], [102, 103], [104, 105], [106, 107]]
    answered_by = {int(group[0].text) for group in completions}
    new_pid = ray.get(engines.actors[1].pid.remote())
    assert new_pid != old_pids[1] and old_pids[1] not in answered_by and answered_by <= {old_pids[0], new_pid}
    assert engines.bundles[1].node_id == placement.bundles[1].node_id  # the same bundle
    first, second = colocation.take_faults(), colocation.take_faults()
    assert (first["faults/engine_restarts"], second["faults/engine_restarts"]) == (1, 0)
    assert first["faults/engine_restart_seconds"] > 0 and second["faults/engine_restart_seconds"] == 0
    assert colocation.stale == {1}  # the new engine has --hf-checkpoint's weights: no actor to give it others

    # The run's one restart is used: the next death fails as before, naming the engine.
    (child_pid,) = ray.get(engines.actors[1].watched_child_pids.remote())
    _kill_soon(child_pid, delay_s=1.0)
    used_up = r"^engine 1 \(SlowEngine, pid .*no engine restart left: --max-engine-restarts 1\)$"
    with pytest.raises(WorkerFailed, match=used_up):
        generate(_prompts(2), sampling)
