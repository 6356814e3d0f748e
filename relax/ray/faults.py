"""Faults injected at named points of a run, for the tests of its fault handling; a real run never sets them.

RELAX_INJECT_FAULTS lists `phase@step=victim`, comma-separated, e.g. `release@1=scheduler,save@2=engine`:
  phase   rollout; release (the engines' memory handed to the actor); push (the weight push, once the first
          bucket has reached the engines); resume (the engines' KV cache resumed after a push); eval (the
          evaluation due at that step: before its rollout, or after the last step at step --num-steps); save
          (the actor saving the step's checkpoint)
  victim  scheduler (engine 0's SGLang scheduler process), engine (engine 0's actor process), rank (training
          rank 0's process)
Each is a SIGKILL, done once per driver process as its phase of that step begins (run_with_restarts keeps one
plan over its attempts, so a resumed run does not meet it again). The process that kills runs on the victim's
node: the driver, or (push) training rank 0; a one-node run.
"""

import os
import signal
from dataclasses import dataclass, field

import psutil
import ray

FAULTS_VAR = "RELAX_INJECT_FAULTS"
PHASES = ("rollout", "release", "push", "resume", "eval", "save")
VICTIMS = ("scheduler", "engine", "rank")


@dataclass
class FaultPlan:
    due: set[tuple[str, int, str]] = field(default_factory=set)  # (phase, step, victim) not yet done
    step: int = 0  # the step the run is in (FaultPlan.at)

    @classmethod
    def from_environ(cls, environ=os.environ) -> "FaultPlan":
        plan = cls()
        for entry in filter(None, (part.strip() for part in environ.get(FAULTS_VAR, "").split(","))):
            phase, _, rest = entry.partition("@")
            step, _, victim = rest.partition("=")
            if phase not in PHASES or victim not in VICTIMS or not step.isdigit():
                raise ValueError(
                    f"{FAULTS_VAR}: {entry!r} is not phase@step=victim with a phase of {PHASES}, a step number and "
                    f"a victim of {VICTIMS}"
                )
            plan.due.add((phase, int(step), victim))
        return plan

    def at(self, step: int) -> None:
        self.step = step

    def take(self, phase: str) -> str | None:
        """The victim due at `phase` of the current step, taken off the plan; None when none is."""
        for due in sorted(self.due):
            if due[:2] == (phase, self.step):
                self.due.remove(due)
                return due[2]
        return None

    def inject(self, phase: str, engines, trainers) -> None:
        """Kill the victim due at `phase` of the current step now, if one is (the groups are relax.ray.placement
        ActorGroups, or None)."""
        victim = self.take(phase)
        if victim is not None:
            os.kill(victim_pid(victim, engines, trainers), signal.SIGKILL)

    def victim_at(self, phase: str, engines, trainers) -> int | None:
        """The pid of the victim due at `phase` of the current step, for the process that kills it mid-phase."""
        victim = self.take(phase)
        return None if victim is None else victim_pid(victim, engines, trainers)


def victim_pid(victim: str, engines, trainers) -> int:
    """The process of `victim`: engine 0's scheduler or actor, or training rank 0 (their actors idle)."""
    if victim == "scheduler":
        children = [psutil.Process(pid) for pid in ray.get(engines.actors[0].watched_child_pids.remote())]
        return next(child.pid for child in children if "scheduler" in " ".join(child.cmdline()))
    group = engines if victim == "engine" else trainers
    return ray.get(group.actors[0].__ray_call__.remote(_own_pid))


def _own_pid(_actor) -> int:
    return os.getpid()
