"""--no-colocate on CPU: relax.run.loop_async.run, whole, through run_with_restarts (as `relax train` runs it) on
its own local Ray cluster, the tiny run's model and sizes (scripts/run-tiny-cpu.sh) with the training rank on one
Ray bundle and the engine on another (--rollout-num-gpus 1: the weights go by broadcast), and with the engine
beside the training rank on its bundle (--rollout-num-gpus 0: the weights go as colocated, nothing sleeping).
Apart, the engine's SGLang scheduler is also killed as step 1's rollout of step 2 begins (RELAX_INJECT_FAULTS,
--max-engine-restarts 1): the engine is restarted in place, and with no other engine to generate on the rollout
waits for step 1's training and pushes its weights to the new engine before it generates.

The engine and the training rank are the loop's own (the real SGLang engine, the real Megatron actor) with a
record: the engine writes when each generate call ran and, once started and after each weight push, its greedy
tokens and logprobs of fixed probe prompts (a restarted engine too); the training rank writes when each step's
training ran. From those and
the run's own files the test checks that every step is logged, that the rollout of step s+1 ran while the actor
trained step s (the records' times and the logged perf/train_overlap_time), that every push reached the engine
(its probe changed) and the last one with the trained weights (its greedy tokens and logprobs are HF
transformers' on the run's --save-hf directory of its last step), and that the run leaves no process behind.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

import relax.run.loop
import relax.run.loop_async
from hf_reference import hf_greedy
from processes import describe, leftover_processes, mark_in_process_run
from relax.args import parse_train_args
from relax.rollout.engine import SamplingConfig
from relax.rollout.synthetic import write_task
from relax.rollout.worker import EngineWorker
from relax.run.inputs import read_inputs
from relax.tools.tiny_model import build_tiny_model
from relax.train.worker import TrainWorker
from tiny_runs import PERF_KEYS

pytestmark = pytest.mark.long  # pytest.ini: not in CI's run

RECORDS_ENV = "RELAX_TEST_RECORDS"  # the directory the engine and the training rank write their records to
PROBE_PROMPTS = [[5, 6, 7], [1, 33, 31, 17, 30, 54, 15]]
PROBE_TOKENS = 6
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=PROBE_TOKENS, ignore_eos=True)
NUM_STEPS = 3
GROUPS_PER_STEP = 8  # prompt groups a step trains on (--rollout-batch-size), each its own generate call
TRAINING_START_WAIT_S = 60.0


def _write(name: str, record: dict) -> None:
    with (Path(os.environ[RECORDS_ENV]) / name).open("a") as f:
        f.write(json.dumps(record) + "\n")


class RecordingEngineWorker(EngineWorker):
    """EngineWorker writing to $RELAX_TEST_RECORDS/engine.jsonl: the wall-clock start and end of each generate call
    (one per prompt group: the rollout dispatches groups), and a probe (greedy tokens and logprobs of PROBE_PROMPTS)
    once started and at the end of each weight push.

    A call of rollout r >= 1 first waits (at most TRAINING_START_WAIT_S) until step r - 1's training has started:
    the loop issues the training before the rollout, but on a loaded machine the training rank may begin it only
    after a tiny rollout has ended, and the records would then show no overlap although the loop overlapped. A loop
    that trained before rolling out still shows its rollout starting after the training ended, and one that rolled
    out before training shows its training starting after the rollout ended (after the wait runs out)."""

    def __init__(self, *args):
        super().__init__(*args)
        self._calls, self._calls_lock = 0, threading.Lock()
        self._probe()

    def generate(self, prompts, sampling, prefixes=None):
        with self._calls_lock:
            rollout = self._calls // GROUPS_PER_STEP
            self._calls += 1
        if rollout > 0:
            _wait_for_training_starts(rollout)
        started = time.time()
        completions = super().generate(prompts, sampling, prefixes)
        _write("engine.jsonl", {"event": "generate", "start": started, "end": time.time()})
        return completions

    def end_weight_update(self, expect_complete: bool = True):
        super().end_weight_update(expect_complete)
        self._probe()

    def _probe(self):
        outputs = [(c.token_ids, c.logprobs) for (c,) in EngineWorker.generate(self, PROBE_PROMPTS, GREEDY)]
        _write("engine.jsonl", {"event": "probe", "outputs": outputs})


def _wait_for_training_starts(count: int) -> None:
    deadline = time.monotonic() + TRAINING_START_WAIT_S
    starts = Path(os.environ[RECORDS_ENV]) / "training_started.jsonl"
    while time.monotonic() < deadline:
        if starts.exists() and len(starts.read_text().splitlines()) >= count:
            return
        time.sleep(0.05)


class RecordingTrainWorker(TrainWorker):
    """TrainWorker writing to $RELAX_TEST_RECORDS/trainer.jsonl the wall-clock start and end of each step's
    training, and to training_started.jsonl a line as each starts (what the engine's rollout waits for)."""

    def train(self, *args):
        _write("training_started.jsonl", {})
        started = time.time()
        metrics = super().train(*args)
        _write("trainer.jsonl", {"start": started, "end": time.time()})
        return metrics


def read_records(path: Path, event: str | None = None) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [record for record in records if event is None or record["event"] == event]


def max_change(probe: list, other: list) -> float:
    """The largest difference between two probes' logprobs."""
    return max(abs(a - b) for (_, logprobs), (_, others) in zip(probe, other) for a, b in zip(logprobs, others))


FAULT_STEP = 1  # apart, the engine's scheduler is killed as this step's rollout (of the next step) begins


@pytest.mark.parametrize("engine_devices, faults", [("1", f"rollout@{FAULT_STEP}=scheduler"), ("0", "")],
                         ids=["apart", "beside"])
def test_the_next_rollout_runs_while_the_actor_trains_and_each_push_reaches_the_engine(tmp_path, monkeypatch,
                                                                                     engine_devices, faults):
    model = build_tiny_model(tmp_path / "model", "qwen3", seed=0)
    data = write_task("copy_digit", 200, tmp_path / "copy_digit.jsonl")
    records, output, hf_saves = tmp_path / "records", tmp_path / "output", tmp_path / "hf"
    records.mkdir()
    config = parse_train_args([  # the tiny script's sizes
        "--device", "cpu", "--hf-checkpoint", str(model),
        "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
        "--reward-fn", "test_loop_two_engines:alternating_reward",  # every step changes the weights
        "--num-steps", str(NUM_STEPS), "--rollout-batch-size", str(GROUPS_PER_STEP), "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "2", "--global-batch-size", "64", "--micro-batch-size", "16",
        "--advantage-estimator", "grpo", "--no-normalize-advantages-by-std", "--lr", "5e-3", "--weight-decay", "0.0",
        "--num-nodes", "1", "--num-devices-per-node", "1", "--no-colocate", "--rollout-num-gpus", engine_devices,
        "--save", str(tmp_path / "checkpoints"), "--save-hf", str(hf_saves), "--output-dir", str(output),
        "--max-engine-restarts", "1" if faults else "0",
    ])
    assert not ray.is_initialized(), "run() must start its own Ray cluster here (another test left one connected)"
    marker = mark_in_process_run(monkeypatch, {RECORDS_ENV: str(records)})  # the records' directory too
    monkeypatch.setenv("RELAX_INJECT_FAULTS", faults)
    monkeypatch.setattr(relax.run.loop, "EngineWorker", RecordingEngineWorker)
    monkeypatch.setattr(relax.run.loop, "TrainWorker", RecordingTrainWorker)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the Ray workers cannot import this file
    try:
        run_async = relax.run.loop_async.run
        assert relax.run.loop.run_with_restarts(config, read_inputs(config), attempt=run_async) == output
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    leftover = leftover_processes(marker)
    assert not leftover, f"processes left behind by the run: {describe(leftover)}"

    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(NUM_STEPS))
    for m in metrics:
        for key in (*set(PERF_KEYS) - {"perf/rollout_time"}, "perf/train_overlap_time", "rollout/reward_mean",
                    "train/loss", "mismatch/logprob_abs_diff_mean"):
            assert key in m, f"step {m['step']} lacks {key}"
        assert m["rollout/reward_mean"] == 0.5 and m["train/update_successful"] == 1.0
        assert m["faults/engine_restarts"] == (1 if faults and m["step"] == FAULT_STEP else 0)
    assert "perf/first_rollout_time" in metrics[0]

    # Rollouts: the first step's, then step s+1's while step s trained, for every step but the last. Each is
    # GROUPS_PER_STEP generate calls, one per group, and rollouts do not overlap each other.
    calls = sorted(read_records(records / "engine.jsonl", "generate"), key=lambda call: call["start"])
    assert len(calls) == NUM_STEPS * GROUPS_PER_STEP
    generated = [
        {"start": min(c["start"] for c in rollout), "end": max(c["end"] for c in rollout)}
        for rollout in (calls[i : i + GROUPS_PER_STEP] for i in range(0, len(calls), GROUPS_PER_STEP))
    ]
    trained = read_records(records / "trainer.jsonl")
    assert len(trained) == NUM_STEPS
    assert generated[0]["end"] <= trained[0]["start"]
    for step in range(NUM_STEPS - 1):
        rollout, training = generated[step + 1], trained[step]
        if faults and step == FAULT_STEP:  # its groups were sent again once the training had ended
            assert rollout["start"] >= training["end"]
        else:
            assert rollout["start"] < training["end"] and training["start"] < rollout["end"], f"step {step}"
        assert metrics[step]["perf/train_overlap_time"] > 0 and "perf/rollout_time" in metrics[step]
        assert trained[step + 1]["start"] >= rollout["end"]  # the next step trains on that rollout
    assert "perf/rollout_time" not in metrics[-1]  # nothing left to roll out after the last step

    # The engine started from the checkpoint and took every push, the last one the weights the run saved last.
    probes = [record["outputs"] for record in read_records(records / "engine.jsonl", "probe")]
    if faults:  # the restarted engine's probe at its start; then step 1's weights, pushed mid-rollout and not again
        restarted = probes.pop(FAULT_STEP + 1)
        assert [tokens for tokens, _ in restarted] == [tokens for tokens, _ in probes[0]]  # --hf-checkpoint's
        assert max_change(restarted, probes[0]) < 1e-5 and max_change(probes[FAULT_STEP + 1], restarted) > 1e-3
    assert len(probes) == 1 + NUM_STEPS
    for step in range(NUM_STEPS):
        assert max_change(probes[step], probes[step + 1]) > 1e-3, f"the push after step {step} changed nothing"
    reference = hf_greedy(hf_saves / f"step_{NUM_STEPS - 1:06d}", PROBE_PROMPTS, PROBE_TOKENS)
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(probes[-1], reference, strict=True):
        assert tokens == hf_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, hf_logprobs)) < 1e-4
