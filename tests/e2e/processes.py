"""The processes of one run, for e2e tests that check what a run leaves behind or kill part of it mid-run.

A test marks its run with a variable only that run's processes carry, in the environment it starts the
run with:

    marker = run_marker()
    subprocess.Popen([... relax train ...], env={**os.environ, **marker})
    scheduler = wait_for_process(marker, "sglang::scheduler")
    ...
    assert not leftover_processes(marker), describe(leftover_processes(marker))

Every process the run starts inherits it: the driver, the Ray cluster the driver starts (ray.init), the
Ray workers of that cluster (actors), SGLang's scheduler and detokenizer. It is read from
/proc/<pid>/environ, the environment a process was started with, so it also finds processes that were
reparented after their parent died, and never another run's processes (other tests, other users) that
happen to have the same names.
"""

import time
import uuid

import psutil

MARKER_VAR = "RELAX_TEST_RUN_ID"


def run_marker() -> dict[str, str]:
    """A variable (name -> unique value) to start one run with."""
    return {MARKER_VAR: uuid.uuid4().hex}


def environ(process: psutil.Process) -> dict[str, str]:
    """The environment `process` was started with; empty when it is gone (or a zombie)."""
    try:
        return process.environ()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return {}


def title(process: psutil.Process) -> str:
    """The process title (Ray and SGLang rename their processes, e.g. ray::TrainWorker.train)."""
    try:
        return " ".join(process.cmdline()) or process.name()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def marked_processes(marker: dict[str, str]) -> list[psutil.Process]:
    """The live processes started with `marker` in their environment (never this test's own process)."""
    ((name, value),) = marker.items()
    found = []
    for process in psutil.process_iter():
        if process.pid != psutil.Process().pid and environ(process).get(name) == value:
            found.append(process)
    return found


def named(processes: list[psutil.Process], name: str) -> list[psutil.Process]:
    """Those of `processes` whose title contains `name`: raylet, gcs_server, ray::TrainWorker,
    ray::EngineWorker, sglang::scheduler, sglang::detokenizer, ..."""
    return [process for process in processes if name in title(process)]


def wait_for_process(marker: dict[str, str], name: str, timeout_s: float = 120.0,
                     still_running=lambda: True) -> psutil.Process:
    """The first marked process titled `name`, once it exists. Raises when `timeout_s` passes or
    `still_running()` turns false (the run ended) before it appears."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and still_running():
        matches = named(marked_processes(marker), name)
        if matches:
            return matches[0]
        time.sleep(0.2)
    raise AssertionError(f"no process titled {name!r} of run {marker} appeared")


def wait_for_title(process: psutil.Process, text: str, timeout_s: float = 120.0, still_running=lambda: True) -> None:
    """Return once `process`'s title contains `text` (Ray titles an actor's process by the call it runs, e.g.
    ray::EngineWorker.generate, while it runs it). Polls every few milliseconds: a call may be short."""
    deadline = time.monotonic() + timeout_s
    while text not in title(process):
        if time.monotonic() > deadline or not still_running() or not process.is_running():
            raise AssertionError(f"process {process.pid} ({title(process)[:80]}) was never titled {text!r}")
        time.sleep(0.005)


def leftover_processes(marker: dict[str, str], wait_s: float = 10.0) -> list[psutil.Process]:
    """The marked processes still alive after up to `wait_s` seconds (Ray's workers exit a moment after the
    raylet that started them)."""
    deadline = time.monotonic() + wait_s
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def kill_marked(marker: dict[str, str]) -> None:
    """SIGKILL every marked process and wait for them (a failed test's cleanup: the run may be stuck)."""
    processes = marked_processes(marker)
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


def describe(processes: list[psutil.Process]) -> str:
    return ", ".join(f"{process.pid} ({title(process)[:80]})" for process in processes) or "none"


def mark_in_process_run(monkeypatch, env: dict[str, str]) -> dict[str, str]:
    """A run_marker() for a run this test's own process drives (relax.run.loop on its own local Ray cluster), set in
    this process's environment with `env`, so that the run's Ray cluster, its actors and SGLang's processes inherit
    them; with the variables run() sets for its local cluster and without RAY_ADDRESS (else run() would join that
    cluster); monkeypatch takes all back after the test. This process's multiprocessing resource tracker (the reward
    function's spawned workers start it) lives as long as this process: started first, it is not counted as the
    run's."""
    import multiprocessing.resource_tracker

    multiprocessing.resource_tracker.ensure_running()
    marker = run_marker()
    for name, value in {**marker, **env, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return marker
