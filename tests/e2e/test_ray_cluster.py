"""relax.ray on a real two-node Ray cluster on this machine (two raylets with their own node ids), started once
(two_node_cluster, tests/e2e/conftest.py).

Both nodes declare 2 GPUs to Ray (no GPU is needed for that: Ray only counts them), the second with the
raylet's CUDA_VISIBLE_DEVICES=2,3 as on a node where devices 0 and 1 are taken, so Ray's physical ids differ
from the logical ones there. Each node also has a custom resource naming it. The same cluster then takes a
job from `relax submit` (through scripts/submit.sh) whose variables exist only in the submitting shell.
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from relax.platform import platform_facts
from relax.ray.envcheck import REPORT_PREFIX, EnvReporter
from relax.ray.runtime_env import WORKER_ENV_NAMES
from relax.ray.placement import (
    ENGINE_DEVICES_ENV,
    ENGINE_RANK_ENV,
    LOCAL_DEVICE_ENV,
    NUM_ENGINES_ENV,
    create_engine_actors,
    create_placement,
    create_training_actors,
    engine_envs,
)

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


# Workers cannot import this test module: Ray ships RankProbe by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


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
