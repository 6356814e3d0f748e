"""A Ray cluster of one or more nodes on this machine, for tests and the CPU demo.

Every node is a `ray start --block` process of its own on ports chosen free, with the cluster's own
temporary directory, usage stats off and token authentication off; the dashboard (Jobs API) listens on
127.0.0.1. The nodes register under the machine's address: on Linux Ray replaces --node-ip-address
127.0.0.1 by it (services.resolve_ip_for_localhost), so the option is not passed. The cluster is torn down
by killing exactly the processes it started (never `ray stop`, which ends every Ray process of the
machine, other users' clusters included).

    with LocalCluster() as cluster:
        cluster.start_head(num_cpus=2)
        cluster.add_node(num_cpus=2, resources={"node_b": 1})
        ray.init(address=cluster.address)
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from relax.ports import free_port

# Environment of every node and of every client of the cluster (drivers, job submission).
# Token auth is off explicitly: with RAY_AUTH_MODE unset, `ray start` turns it on as soon as an earlier
# ray.init() has left ~/.ray/auth_token behind, and clients then fail with "Authentication required".
CLUSTER_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}

_STARTED_LINE = "Ray runtime started"
_START_ATTEMPTS = 3


class LocalCluster:
    def __init__(self, start_timeout_s: float = 90.0):
        # A short path: Ray puts unix sockets under it and their paths are limited to 107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="relax-ray-"))
        self.start_timeout_s = start_timeout_s
        self.address: str | None = None  # GCS address, for ray.init(address=...) and `ray start --address`
        self.dashboard_url: str | None = None  # for the Jobs API (relax submit --address)
        self._nodes: list[subprocess.Popen] = []

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def client_env(self) -> dict[str, str]:
        """Variables a driver or `relax submit` process needs to reach this cluster."""
        return {**CLUSTER_ENV, "RAY_ADDRESS": self.address or ""}

    def start_head(self, num_cpus: int, num_gpus: int | None = None, resources: dict | None = None,
                   env: dict[str, str] | None = None) -> None:
        if self._nodes:
            raise RuntimeError("LocalCluster.start_head: the head is already started")

        def head_args():  # fresh ports for each attempt
            gcs_port, dashboard_port = free_port(), free_port()
            self.address = f"127.0.0.1:{gcs_port}"
            self.dashboard_url = f"http://127.0.0.1:{dashboard_port}"
            return ["--head", f"--port={gcs_port}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={free_port()}",
                    f"--temp-dir={self.temp_dir}"]

        self._start_node("head", head_args, num_cpus, num_gpus, resources, env)

    def add_node(self, num_cpus: int, num_gpus: int | None = None, resources: dict | None = None,
                 env: dict[str, str] | None = None) -> None:
        """Another raylet joining the head: a node of its own (own node id and resources) on this machine."""
        if self.address is None:
            raise RuntimeError("LocalCluster.add_node: call start_head first")
        self._start_node(f"node{len(self._nodes)}", lambda: [f"--address={self.address}"],
                         num_cpus, num_gpus, resources, env)

    def _start_node(self, name, role_args, num_cpus, num_gpus, resources, env) -> None:
        """Start a node, again on fresh ports when it fails: on a loaded machine the raylet can miss the
        30 s Ray gives it to register (node.py: "The current node timed out during startup")."""
        for attempt in range(1, _START_ATTEMPTS + 1):
            log_path = self.temp_dir / f"{name}-{attempt}.log"
            process = self._launch(role_args(), num_cpus, num_gpus, resources, env, log_path)
            deadline = time.monotonic() + self.start_timeout_s
            while process.poll() is None and time.monotonic() < deadline:
                if _STARTED_LINE in log_path.read_text():
                    self._nodes.append(process)
                    return
                time.sleep(0.2)
            _kill_tree(process)
        output = log_path.read_text()
        self.stop()
        raise RuntimeError(f"LocalCluster: `ray start` of {name} failed {_START_ATTEMPTS} times; last output:\n"
                           f"{output[-4000:]}")

    def _launch(self, role_args, num_cpus, num_gpus, resources, env, log_path) -> subprocess.Popen:
        command = [
            str(Path(sys.executable).with_name("ray")), "start", "--block", *role_args,
            "--disable-usage-stats",
            f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources or {})}",
            # Ports every node would otherwise take at fixed defaults (clashing with a second node here, or
            # with someone else's cluster on this machine).
            f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
            "--min-worker-port=0", "--max-worker-port=0",  # 0: each worker takes a port the OS gives it
        ]
        if num_gpus is not None:
            command.append(f"--num-gpus={num_gpus}")
        with open(log_path, "w") as log:
            return subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **CLUSTER_ENV, **(env or {})}, start_new_session=True,
            )

    def processes(self) -> list[psutil.Process]:
        """Every live process of this cluster: the `ray start` processes, their descendants, and any process
        whose command line names this cluster's temporary directory (workers reparented after a crash)."""
        found: dict[int, psutil.Process] = {}
        for node in self._nodes:
            try:
                root = psutil.Process(node.pid)
                found[root.pid] = root
                found.update((child.pid, child) for child in root.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        marker = str(self.temp_dir)
        for process in psutil.process_iter(["cmdline"]):
            if any(marker in part for part in process.info["cmdline"] or ()):
                found.setdefault(process.pid, process)
        return [process for process in found.values() if _alive(process)]

    def stop(self, wait_s: float = 10.0) -> None:
        """Kill every process of this cluster and remove its temporary directory.

        SIGKILL at once: a throwaway cluster has nothing to save, and Ray's daemons take many seconds over
        SIGTERM. Repeated until none is left, for workers a raylet was starting meanwhile."""
        deadline = time.monotonic() + wait_s
        while processes := self.processes():
            if time.monotonic() > deadline:
                raise RuntimeError(f"LocalCluster.stop: processes left: {[process.pid for process in processes]}")
            for process in processes:
                _signal(process, signal.SIGKILL)
            for node in self._nodes:  # our own children: wait() reaps them
                if node.pid in {process.pid for process in processes}:
                    node.wait()
            psutil.wait_procs(processes, timeout=1)
        self._nodes.clear()
        # Ray removes nothing on its own; a leftover ray_current_cluster would redirect later ray.init()s.
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _kill_tree(process: subprocess.Popen) -> None:
    """Kill a `ray start` process that did not come up, and everything it started."""
    try:
        tree = [psutil.Process(process.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for member in tree:
        _signal(member, signal.SIGKILL)
    process.wait()
    psutil.wait_procs(tree, timeout=5)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(process: psutil.Process, signum: int) -> None:
    try:
        process.send_signal(signum)
    except psutil.NoSuchProcess:
        pass
