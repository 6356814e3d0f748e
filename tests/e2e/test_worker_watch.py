"""The liveness watch (relax.ray.watch, wait_for in relax.ray.placement) on a real two-node Ray cluster on this
machine (two_node_cluster, tests/e2e/conftest.py): while the driver waits on one group's slow calls, an actor
of another group (one with no call pending, so only the watch can notice) or a child process an actor
depends on is killed, and the wait fails at once, naming the actor, its pid, node and log. A call that does not
answer within its Timeout fails naming the actor it was called on. Engines restarted in place
(relax.run.colocation) on these actors: a share whose engine's child dies is answered by the new actor.

The bound on each wait is a hang guard (the slow calls take 60 s; a wait that ends well before them ended
because of the death), not a timing test."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import ray

from relax.platform import platform_facts
from relax.ray.placement import (
    WorkerFailed, create_engine_actors, create_placement, create_training_actors, wait_for,
)
from relax.ray.watch import Timeout
from relax.rollout.data import Prompt
from relax.rollout.engine import Completion, SamplingConfig
from relax.ray.faults import FaultPlan
from relax.run.colocation import Colocation

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


# Workers cannot import this test module: Ray ships its classes by value.
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
