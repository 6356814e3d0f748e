"""Liveness watch of placed actors: one ProcessWatcher actor per node and actor group polls the processes of
the group's actors on its node, and its `watch` call returns as soon as one of them is gone.

The driver waits on a phase's refs and on these watch refs together (relax.ray.placement.wait_for), so a
worker that dies is reported within seconds, whatever phase the driver is waiting on, not at the driver's
next call on that worker (which may come a whole phase later).

Why a watcher process rather than a watch method in each worker's own concurrency group: in a sync Ray actor
with any concurrency group, every method runs on a pool thread instead of the main thread that ran
__init__ (measured on Ray 2.60), and a thread-local device selection (torch.cuda.set_device, NPU alike)
made in __init__ would not hold in the worker's methods.

A worker class may say which processes besides its own it cannot work without by a method
`watched_child_pids() -> list[int]` (EngineWorker: SGLang's scheduler and detokenizer, which a SIGKILL
ends without the engine actor noticing until its next call).
"""

import time
from dataclasses import dataclass

import psutil

POLL_S = 1.0


@dataclass(frozen=True)
class Timeout:
    """How long the driver waits on a call that may hang although every process still runs (a deadlocked
    rank, an engine whose detokenizer stopped answering, a process group whose rendezvous never completes);
    relax.ray.placement.wait_for fails naming the actor that did not answer."""

    seconds: float | None  # None: no bound
    setting: str  # what sets it, named in the failure: the flag to raise

    def __post_init__(self):
        if self.seconds is not None and self.seconds <= 0:
            raise ValueError(f"{self.setting}: must be > 0, got {self.seconds:g}")

    def describe(self) -> str:
        return f"{self.seconds:g} s ({self.setting}; raise it if this call needs longer)"


def process_records(pids: list[int]) -> list[dict]:
    """pid, start time (so a reused pid is not taken for the process) and title of each process."""
    records = []
    for pid in pids:
        process = psutil.Process(pid)
        with process.oneshot():
            # Whitespace collapsed: setproctitle pads titles (sglang::scheduler) with spaces.
            title = " ".join(" ".join(process.cmdline()).split()) or process.name()
            records.append({"pid": pid, "created": process.create_time(), "title": title[:60]})
    return records


# psutil's start time in seconds since the epoch is the start since boot plus the boot time, which the kernel
# recomputes from the system clock: a clock correction moves it by whole seconds (seen on CI: a live actor's start
# time read 1 s later than recorded). The recorded time is matched within this slack once, when the watch begins;
# from then on psutil's own identity (the start since boot on Linux and macOS) tells a reused pid.
CLOCK_SLACK_S = 2.0


def _gone(pid: int) -> str:
    return "exited (its pid now belongs to another process)" if psutil.pid_exists(pid) else "exited"


def attach(record: dict) -> psutil.Process | str:
    """The recorded process, or what became of it if it is gone already."""
    try:
        process = psutil.Process(record["pid"])
        if abs(process.create_time() - record["created"]) > CLOCK_SLACK_S:
            return _gone(record["pid"])
    except psutil.NoSuchProcess:
        return "exited"
    return process


def process_state(process: psutil.Process) -> str | None:
    """None while the process runs, else what became of it."""
    if not process.is_running():  # also False where its pid was reused
        return _gone(process.pid)
    try:
        if process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return "exited (a zombie now)"
    except psutil.NoSuchProcess:
        return "exited"
    return None


class ProcessWatcher:
    """Runs on one node (a Ray actor); watches the processes of actors that run there."""

    def watch(self, indices: list[int], *whereabouts: dict) -> dict:
        """Return when a process of actor `indices[k]` (`whereabouts[k]["processes"]`, its own first) is
        gone: that actor's index, the process and what became of it. Never returns while all run.

        The whereabouts are Ray refs resolved before this starts: an actor that died in its __init__ makes
        this call fail with that actor's error."""
        watched = [
            (index, record, position == 0, attach(record))
            for index, where in zip(indices, whereabouts, strict=True)
            for position, record in enumerate(where["processes"])
        ]
        while True:
            for index, record, own, process in watched:
                state = process if isinstance(process, str) else process_state(process)
                if state is not None:
                    return {"index": index, "own": own, **record, "state": state}
            time.sleep(POLL_S)
