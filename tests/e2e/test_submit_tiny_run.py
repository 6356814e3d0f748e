"""The tiny CPU run (scripts/run-tiny-cpu.sh) submitted as a Ray job through scripts/submit.sh (`relax submit`)
to a Ray head started beforehand, as on a cluster: variables exported only in the submitting shell reach
the job's driver, the training actor, the SGLang engine actor and the engine's own subprocesses.

The proof is each process's environment as the kernel holds it (/proc/<pid>/environ, read while the job
runs): the processes are this cluster's (descendants of its `ray start`), picked by their titles.
"""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from processes import environ, title
from relax.ray.local_cluster import LocalCluster
from tiny_runs import step_records

pytestmark = pytest.mark.long  # pytest.ini: not in CI's run

REPO = Path(__file__).resolve().parents[2]
# Titles of the run's processes that must see the submitting shell's variables.
WORKER_TITLES = ("relax.cli train", "ray::TrainWorker", "ray::EngineWorker", "sglang::scheduler", "sglang::detokenizer")
NUM_STEPS = 2


def test_submitted_tiny_run_gets_the_submitting_shell_in_every_worker(tmp_path):
    # One variable relax reads by its own prefix and one of another prefix workers read (SGLang's).
    exported = {"RELAX_TEST_MARKER": uuid.uuid4().hex, "SGLANG_TEST_MARKER": uuid.uuid4().hex}
    with LocalCluster() as cluster:
        cluster.start_head(num_cpus=2)
        shell = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
        shell.update(**cluster.client_env, **exported, EXP_DIR=str(tmp_path), RELAX_PYTHON=sys.executable)
        log_path = tmp_path / "submit.log"  # a file, not a pipe: nothing reads it while the job runs
        with open(log_path, "w") as log:
            submit = subprocess.Popen(
                ["bash", str(REPO / "scripts" / "submit.sh"), "--address", cluster.dashboard_url, "--env", "EXP_DIR",
                 "--", "bash", str(REPO / "scripts" / "run-tiny-cpu.sh"), "--num-steps", str(NUM_STEPS)],
                env=shell, stdout=log, stderr=subprocess.STDOUT,
            )
            seen = _watch_environments(cluster, submit, list(exported), timeout_s=600)
        assert submit.returncode == 0, log_path.read_text()[-8000:]
        # The job's driver ended its actors and engines; the cluster, not the job's, stays up.
        assert not _run_processes_left(cluster, wait_s=10), _run_processes_left(cluster, wait_s=0)
        raylet_envs = [environ(process) for process in cluster.processes()
                       if title(process).partition(" ")[0].endswith("/raylet")]  # the raylet binary itself
    assert cluster.processes() == [], "processes of the test cluster were left running"

    records = [json.loads(line) for line in (tmp_path / "output" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in step_records(records)] == list(range(NUM_STEPS))
    # The cluster was started without them: the job's runtime_env is the only way they could arrive.
    assert raylet_envs and all(env and not set(exported) & set(env) for env in raylet_envs)
    for name in WORKER_TITLES:
        assert seen[name], f"no process titled {name!r} was seen while the job ran; seen: {seen}"
        for pid, values in seen[name].items():
            assert values == exported, f"{name} (pid {pid}) started with {values}, not the shell's {exported}"


def _watch_environments(cluster: LocalCluster, submit: subprocess.Popen, names: list[str],
                        timeout_s: float) -> dict[str, dict[int, dict]]:
    """While the job runs: title -> {pid: the values of `names` in its environment} of every process of
    the cluster with one of WORKER_TITLES. A process's title is set after it starts, so a titled process's
    environment is final. Each process lives for a whole step or longer; a look every 0.2 s sees it."""
    seen = {name: {} for name in WORKER_TITLES}
    deadline = time.monotonic() + timeout_s
    while submit.poll() is None:
        assert time.monotonic() < deadline, f"the job did not finish within {timeout_s} s"
        for process in cluster.processes():
            process_title = title(process)
            for name in WORKER_TITLES:
                if name in process_title and process.pid not in seen[name]:
                    env = environ(process)
                    if env:  # empty once it has exited: nothing to learn
                        seen[name][process.pid] = {variable: env.get(variable) for variable in names}
        time.sleep(0.2)
    return seen


def _run_processes_left(cluster: LocalCluster, wait_s: float) -> list[str]:
    """Titles of the run's processes (WORKER_TITLES) still in the cluster after up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        titles = [title(process) for process in cluster.processes()]
        left = [text for text in titles if any(name in text for name in WORKER_TITLES)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)
