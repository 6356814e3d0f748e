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


# How far apart two readings of one process's start since boot may be: the boot time may move between the two
# reads of started_since_boot (whole seconds).
START_SLACK_S = 1.5


def started_since_boot(process: psutil.Process) -> float:
    """When `process` started, in seconds since the machine booted. psutil's start time is in seconds since the
    epoch: the start since boot plus the boot time, which the kernel recomputes from the system clock, so a clock
    correction moves it (seen on CI: a live actor's start read 1 s later than recorded) but not this difference."""
    return process.create_time() - psutil.boot_time()


def process_records(pids: list[int]) -> list[dict]:
    """pid, start (so a reused pid is not taken for the process) and title of each process."""
    records = []
    for pid in pids:
        process = psutil.Process(pid)
        with process.oneshot():
            # Whitespace collapsed: setproctitle pads titles (sglang::scheduler) with spaces.
            title = " ".join(" ".join(process.cmdline()).split()) or process.name()
            records.append({"pid": pid, "started": started_since_boot(process), "title": title[:60]})
    return records


def process_state(record: dict) -> str | None:
    """None while the recorded process runs, else what became of it."""
    try:
        process = psutil.Process(record["pid"])
        if abs(started_since_boot(process) - record["started"]) > START_SLACK_S:
            return "exited (its pid now belongs to another process)"
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
            (index, record, position == 0)
            for index, where in zip(indices, whereabouts, strict=True)
            for position, record in enumerate(where["processes"])
        ]
        while True:
            for index, record, own in watched:
                state = process_state(record)
                if state is not None:
                    return {"index": index, "own": own, **record, "state": state}
            time.sleep(POLL_S)
