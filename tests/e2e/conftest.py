"""CPU test sessions start on the CPU platform, prepared before any test imports SGLang or Megatron:
SGLang fixes its device at its first import, so test module order must not matter. (tests/gpu has no
such conftest: its tests pick the GPU platform themselves.)

Shared fixtures: two_node_cluster, a real two-node Ray cluster on this machine, one per test module;
saved_tiny_run, one run of the tiny job that saves checkpoints, for the whole session (all its lanes)."""

import fcntl
import os
from dataclasses import dataclass

import pytest
import ray

os.environ.setdefault("RELAX_DEVICE", "cpu")  # workers the tests start inherit it

from relax.platform import get_platform  # noqa: E402
from relax.ray.local_cluster import CLUSTER_ENV, LocalCluster  # noqa: E402
from tiny_runs import SavedTinyRun, read_saved_tiny_run, run_saving_tiny_job  # noqa: E402

get_platform("cpu").prepare_sglang()
get_platform("cpu").prepare_megatron()


@dataclass
class TwoNodeCluster:
    local: LocalCluster
    node_names: dict[str, str]  # node id -> the custom resource naming it


@pytest.fixture(scope="module")
def two_node_cluster():
    """Two raylets with their own node ids, each with 4 CPUs, 2 GPUs counted by Ray (no GPU is needed for
    that) and a custom resource naming it (relax_test_node_a / _b); the second raylet has
    CUDA_VISIBLE_DEVICES=2,3, as on a node where devices 0 and 1 are taken. This process is connected to it."""
    # The raylets start without the variables the submit test exports: only the submitting shell has them.
    saved = {name: os.environ.get(name) for name in CLUSTER_ENV}
    os.environ.update(CLUSTER_ENV)
    local = LocalCluster()
    try:
        local.start_head(num_cpus=4, num_gpus=2, resources={"relax_test_node_a": 1})
        local.add_node(num_cpus=4, num_gpus=2, resources={"relax_test_node_b": 1}, env={"CUDA_VISIBLE_DEVICES": "2,3"})
        ray.init(address=local.address)
        node_names = {}
        for node in ray.nodes():
            if not node["Alive"]:  # a start attempt that timed out on a loaded machine
                continue
            (name,) = [resource for resource in node["Resources"] if resource.startswith("relax_test_node_")]
            node_names[node["NodeID"]] = name
        yield TwoNodeCluster(local, node_names)
    finally:
        ray.shutdown()
        local.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    assert local.processes() == [], "Ray processes of the test cluster were left running"


@pytest.fixture(scope="session")
def saved_tiny_run(tmp_path_factory) -> SavedTinyRun:
    """The tiny job's run that saves checkpoints (tiny_runs.run_saving_tiny_job), shared by test_loop (what a run
    logs and leaves behind), test_loop_resume (resuming it) and test_loop_faults (the same run with faults): one
    start of the whole stack for the session. The first lane to need it runs it while the others wait on a file
    lock, then each reads it from its directory, which no test writes into (a test that continues the run copies
    it)."""
    session_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a lane's base directory is inside the session's
        session_dir = session_dir.parent
    exp_dir, failure = session_dir / "saved_tiny_run", session_dir / "saved_tiny_run.failed"
    with open(session_dir / "saved_tiny_run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        if failure.exists():  # not run again: each lane would wait for the same failure
            pytest.fail(f"the saved tiny run failed in another lane:\n{failure.read_text()}")
        if not exp_dir.exists():
            exp_dir.mkdir()
            try:
                run_saving_tiny_job(exp_dir)
            except BaseException as error:
                failure.write_text(str(error)[-6000:])
                raise
    return read_saved_tiny_run(exp_dir)
