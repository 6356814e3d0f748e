"""Workers of the tiny colocated run (scripts/run-tiny-cpu.sh) killed with SIGKILL mid-run.

An engine killed in every other phase, in one run (RELAX_INJECT_FAULTS, relax.ray.faults): the device hand-over
to the actor, the actor's checkpoint save (the engine is restarted at its next call, not while the actor holds the
devices), the weight push (after its first bucket), the KV cache's resume after the push. Each time the engine is started again in place and the phase goes
on (relax.run.colocation); the run ends with the rollouts, evaluations and saved weights of the same run without
faults (saved_tiny_run).

Then, in another run, the engine's SGLang scheduler, mid-rollout: the engine is started again in place, given the actor's weights,
and its requests sent again with their seeds (relax.run.colocation); the step completes with the rewards
of a run without the fault (saved_tiny_run: deterministic inference, the same learning rate). Then a training rank:
the driver fails soon, with a message naming the worker that died and where its log is, and no process of the run
is left. (An engine failing once its --max-engine-restarts are used up fails the run as a training rank's death
does: tests/e2e/test_ray_cluster.py.)

The bound on the driver's exit is a hang guard (a dead worker must not leave the driver waiting forever),
not a timing test. Each test asks for the run without faults only once its own run has ended: another lane may be
running it meanwhile (tests/e2e/conftest.py)."""

import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from processes import describe, kill_marked, leftover_processes, run_marker, wait_for_process, wait_for_title
from relax.run.metrics import read_metrics
from tiny_runs import SAVING_RUN_STEPS, eval_flags, run_tiny_job, step_records, tiny_job

pytestmark = pytest.mark.long  # pytest.ini: not in CI's run

HANG_GUARD_S = 120


def _wait_for_steps(count: int, metrics: Path, run: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= count):
        assert run.poll() is None, f"the run ended before its step {count - 1}:\n{log.read_text()[-6000:]}"
        assert time.monotonic() < deadline, f"no step {count - 1} within {timeout_s} s"
        time.sleep(0.2)


def _wait_for_exit(run: subprocess.Popen, victim: str, log: Path) -> float:
    """Seconds from now until the driver exits (a test failure past HANG_GUARD_S)."""
    killed_at = time.monotonic()
    try:
        run.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the driver was still running {HANG_GUARD_S} s after {victim} was killed:\n"
                    f"{log.read_text()[-6000:]}")
    return time.monotonic() - killed_at


def _failure_line(output: str, named: str, pid: int) -> str:
    """The driver's one-line message: which worker, its process, its log, and why."""
    failure = [line for line in output.splitlines() if line.startswith("relax train: ")]
    assert failure, output[-6000:]
    assert f"{named} (" in failure[-1] and str(pid) in failure[-1], failure[-1]
    log_file = re.search(r"log: (\S+\.err)", failure[-1])
    assert log_file and Path(log_file.group(1)).is_file(), failure[-1]
    return failure[-1]


def _kill_scheduler_mid_generate(marker: dict, run: subprocess.Popen):
    """SIGKILL the engine's SGLang scheduler while its engine actor runs a generate call; the scheduler. (On the CPU
    the scheduler's parent is the server it was forked from, not the engine actor: relax.platform.cpu_sglang.)"""
    scheduler = wait_for_process(marker, "sglang::scheduler", still_running=lambda: run.poll() is None)
    engine = wait_for_process(marker, "ray::EngineWorker", still_running=lambda: run.poll() is None)
    wait_for_title(engine, "EngineWorker.generate", still_running=lambda: run.poll() is None)
    scheduler.kill()
    return scheduler


@pytest.mark.timeout(900)  # the run, then the wait for the saved run, which another lane may still be running
def test_an_engine_killed_mid_rollout_restarts_in_place_then_a_training_rank_killed_fails_the_run(tmp_path, request):
    marker = run_marker()
    log_path, metrics = tmp_path / "run.log", tmp_path / "output" / "metrics.jsonl"
    with open(log_path, "w") as log:
        # Far more steps than the test waits for: the run is always mid-way when the training rank is killed. The
        # learning rate is constant, so the first steps are the saved run's.
        command, env = tiny_job(
            tmp_path, "--num-steps", "1000", "--sglang-enable-deterministic-inference", "--max-engine-restarts", "1",
            env=marker,
        )
        run = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_steps(1, metrics, run, log_path)
        _kill_scheduler_mid_generate(marker, run)  # a rollout: the engine restarts, the step completes
        _wait_for_steps(metrics.read_text().count("\n") + 1, metrics, run, log_path)  # the step that restarted
        rank = wait_for_process(marker, "ray::TrainWorker", still_running=lambda: run.poll() is None)
        rank.kill()
        waited = _wait_for_exit(run, f"training rank 0 (pid {rank.pid})", log_path)
    finally:
        if run.poll() is None:  # the test failed: end the whole run, not only its driver
            kill_marked(marker)
            run.wait()
    output = log_path.read_text()
    assert run.returncode == 1, output[-6000:]
    rows = read_metrics(metrics)
    print(f"training rank 0 killed after {len(rows)} step(s); the driver exited {waited:.1f} s later")
    # The kill lands in the first rollout the test catches after step 0 (usually step 1's, a later one's on a
    # loaded machine): one step restarted its engine.
    restarts = [row["faults/engine_restarts"] for row in rows]
    assert restarts[0] == 0 and restarts.count(1) == 1 and sum(restarts) == 1, (restarts, output[-6000:])
    assert "relax: engine 0 (EngineWorker, " in output, output[-6000:]
    assert "starting it again on its devices (engine restart 1 of at most 1" in output, output[-6000:]
    # The restarted engine had the actor's weights of the step before and sampled its requests with their seeds.
    saved_steps = step_records(request.getfixturevalue("saved_tiny_run").records)
    compared = rows[: len(saved_steps)]
    for key in ("rollout/reward_mean", "rollout/response_tokens"):
        assert [row[key] for row in compared] == [row[key] for row in saved_steps[: len(compared)]], key
    # Either the driver's liveness watch (relax.ray.watch) reports the rank's death, within about a second, or the
    # call the driver waits on fails first (Ray reports a dead actor to calls on it): the tiny run's phases are too
    # short to tell which. tests/e2e/test_ray_cluster.py shows the watch alone.
    _failure_line(output, "training rank 0", rank.pid)
    leftover = leftover_processes(marker)
    assert not leftover, f"processes of the run left behind: {describe(leftover)}"


# Engine 0's scheduler or actor process, killed as each phase of each step begins (push: after its first bucket).
# The evaluation restarts an engine as the rollout does (the same generate call): the second test kills one there.
# A scheduler killed mid-push fails the training rank's next call on it: the rank raises the engine's error, which
# must still be taken as the engine's death (relax.ray.placement.worker_failure).
INJECTED = {"release@0": "scheduler", "save@1": "scheduler", "push@2": "scheduler", "resume@3": "engine"}
BUCKET_BYTES = 8 << 20  # the tiny model's weights in several buckets: the push is killed mid-way


@pytest.mark.timeout(900)
def test_an_engine_killed_in_each_phase_restarts_in_place_and_the_run_ends_as_one_without_faults(tmp_path, request):
    marker = run_marker()
    faults = ",".join(f"{point}={victim}" for point, victim in INJECTED.items())
    saves, hf_saves = tmp_path / "checkpoints", tmp_path / "hf"
    started = time.monotonic()
    records = run_tiny_job(
        tmp_path, "--num-steps", str(SAVING_RUN_STEPS), "--sglang-enable-deterministic-inference",
        "--save", str(saves), "--save-interval", "2", "--save-hf", str(hf_saves), *eval_flags(tmp_path),
        "--max-engine-restarts", str(len(INJECTED)), "--update-weight-buffer-size", str(BUCKET_BYTES),
        env={**marker, "RELAX_INJECT_FAULTS": faults},
    )
    print(f"the run with {len(INJECTED)} engine restarts took {time.monotonic() - started:.0f} s")
    leftover = leftover_processes(marker)
    assert not leftover, f"processes of the run left behind: {describe(leftover)}"
    # Each restart is counted in the row of the step (or of the evaluation after the last step) it happened in.
    restarts = {row["step"]: row["faults/engine_restarts"] for row in records}
    assert restarts == {0: 1, 1: 1, 2: 1, 3: 1, 4: 0}, restarts
    seconds = {row["step"]: row["faults/engine_restart_seconds"] for row in records}
    assert all((seconds[step] > 0) == (count > 0) for step, count in restarts.items()), seconds
    print("restart seconds per row:", {step: round(s, 1) for step, s in seconds.items()})
    # The same rollouts and evaluations as the run without faults: the restarted engines had the actor's weights.
    saved_tiny_run = request.getfixturevalue("saved_tiny_run")
    for faulted, clean in zip(records, saved_tiny_run.records, strict=True):
        compared = [key for key in clean if key.startswith(("rollout/", "eval/"))]
        assert compared and {k: faulted[k] for k in compared} == {k: clean[k] for k in compared}, faulted["step"]
    # The same trained weights, bit for bit.
    for step in ("step_000001", "step_000003"):
        faulted, clean = (load_file(d / step / "model.safetensors") for d in (hf_saves, saved_tiny_run.hf_saves))
        assert faulted.keys() == clean.keys()
        assert all(torch.equal(faulted[name], clean[name]) for name in clean), step
