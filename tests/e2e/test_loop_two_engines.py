"""The colocated loop with two SGLang engines and two training ranks (DP=2, gloo) on CPU: relax.run.loop.run, whole,
on its own local Ray cluster, the tiny run's model and task (scripts/run-tiny-cpu.sh) with
--num-devices-per-node 2 --rollout-num-devices-per-engine 1.

The engines are the loop's EngineWorker (the real SGLang engine) with a record: each one writes what it
was asked to generate and answered, and the greedy tokens and logprobs of fixed probe prompts when it starts
and after each weight push. From those and the run's own files the test checks that every step is logged,
that both engines generated every step (each prompt group whole on the engine with the fewest requests in
flight, the requests' seeds numbered across the engines in submission order), that the saved rollout holds the
engines' completions in prompt order, that each push
reached both engines (the same greedy outputs from both, changed by training), and that the run leaves no
process behind.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import ray

import relax.run.loop
from generations import assert_same_generations, largest_logprob_change
from processes import describe, leftover_processes, mark_in_process_run
from relax.args import parse_train_args
from relax.ray.placement import ENGINE_RANK_ENV
from relax.rollout.dump import rollout_data_path
from relax.rollout.engine import SamplingConfig
from relax.rollout.synthetic import write_task
from relax.rollout.worker import EngineWorker
from relax.run.inputs import read_inputs
from relax.tools.tiny_model import build_tiny_model
from tiny_runs import PERF_KEYS

pytestmark = pytest.mark.long  # pytest.ini: not in CI's run

RECORDS_ENV = "RELAX_TEST_ENGINE_RECORDS"  # the directory the engines write their records to
PROBE_PROMPTS = [[5, 6, 7], [1, 33, 31, 17, 30, 54, 15]]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)
NUM_STEPS, PROMPTS_PER_STEP, SAMPLES_PER_PROMPT = 2, 3, 4


class RecordingEngineWorker(EngineWorker):
    """EngineWorker writing to $RELAX_TEST_ENGINE_RECORDS/engine-<rank>.jsonl: each generate call (prompts,
    first seed, response tokens; a prompt group's calls run at once, so they are written as each completes), and a probe (greedy tokens and logprobs of PROBE_PROMPTS) once started and
    whenever its KV cache is resumed, which ends each weight push (relax.run.colocation.Colocation.to_engines)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.record_file = Path(os.environ[RECORDS_ENV]) / f"engine-{os.environ[ENGINE_RANK_ENV]}.jsonl"
        self._probe()

    def generate(self, prompts, sampling, prefixes=None):
        completions = super().generate(prompts, sampling, prefixes)
        responses = [[c.token_ids for c in group] for group in completions]
        self._write({"event": "generate", "prompts": prompts, "seed": sampling.seed, "responses": responses})
        return completions

    def resume_memory_occupation(self, tags):
        super().resume_memory_occupation(tags)
        if "kv_cache" in tags:
            self._probe()

    def _probe(self):
        outputs = [(c.token_ids, c.logprobs) for (c,) in EngineWorker.generate(self, PROBE_PROMPTS, GREEDY)]
        self._write({"event": "probe", "outputs": outputs})

    def _write(self, record):
        with self.record_file.open("a") as f:
            f.write(json.dumps(record) + "\n")


def alternating_reward(samples):
    """1, 0, 1, 0, ... over the step's samples (n consecutive per prompt, n even): every group's rewards
    differ, so every step has advantages and changes the weights, which the copy_digit reward of a random
    model does not promise."""
    return [float(i % 2) for i in range(len(samples))]


def read_records(directory: Path, engine: int, event: str) -> list[dict]:
    lines = (directory / f"engine-{engine}.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["event"] == event]


def test_two_engines_and_two_training_ranks_share_every_step_and_take_every_push(tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "model", "qwen3", seed=0)
    data = write_task("copy_digit", 20, tmp_path / "copy_digit.jsonl")
    records, output = tmp_path / "engine_records", tmp_path / "output"
    records.mkdir()
    rollout_pattern = str(tmp_path / "rollouts" / "step_{step}.jsonl")
    config = parse_train_args([
        "--device", "cpu", "--hf-checkpoint", str(model),
        "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--reward-fn", f"{__name__}:alternating_reward",
        "--num-steps", str(NUM_STEPS), "--rollout-batch-size", str(PROMPTS_PER_STEP),
        "--n-samples-per-prompt", str(SAMPLES_PER_PROMPT), "--rollout-max-response-len", "2",
        "--global-batch-size", str(PROMPTS_PER_STEP * SAMPLES_PER_PROMPT), "--micro-batch-size", "2",
        "--lr", "1e-2", "--weight-decay", "0.0",
        "--num-nodes", "1", "--num-devices-per-node", "2", "--rollout-num-devices-per-engine", "1",
        "--save-rollout-data", rollout_pattern, "--output-dir", str(output),
    ])
    assert not ray.is_initialized(), "run() must start its own Ray cluster here (another test left one connected)"
    marker = mark_in_process_run(monkeypatch, {RECORDS_ENV: str(records)})  # the records' directory too
    monkeypatch.setattr(relax.run.loop, "EngineWorker", RecordingEngineWorker)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the Ray workers cannot import this file
    try:
        relax.run.loop.run(config, read_inputs(config))
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])

    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(NUM_STEPS))
    for m in metrics:
        for key in (*PERF_KEYS, "rollout/reward_mean", "train/loss", "train/grad_norm"):
            assert key in m, f"step {m['step']} lacks {key}"
        assert m["rollout/reward_mean"] == 0.5 and m["train/update_successful"] == 1.0

    # Every step: one call per prompt group, balanced by the requests in flight: the first and third prompts on
    # engine 0, the second on engine 1 (ties go to engine 0); the requests' seeds run on in submission order across
    # the engines; the saved rollout is their completions in prompt order.
    calls = [read_records(records, engine, "generate") for engine in (0, 1)]
    assert [len(engine_calls) for engine_calls in calls] == [2 * NUM_STEPS, NUM_STEPS]
    assert all(len(call["prompts"]) == 1 for engine_calls in calls for call in engine_calls)
    for step in range(NUM_STEPS):
        first, third = sorted(calls[0][2 * step : 2 * step + 2], key=lambda call: call["seed"])
        second = calls[1][step]
        assert second["seed"] == first["seed"] + SAMPLES_PER_PROMPT
        assert third["seed"] == first["seed"] + 2 * SAMPLES_PER_PROMPT
        saved = rollout_data_path(rollout_pattern, step).read_text().splitlines()[1:]
        groups = [json.loads(line) for line in saved]
        assert [g["prompt"]["token_ids"] for g in groups] == first["prompts"] + second["prompts"] + third["prompts"]
        responses = [[s["response_token_ids"] for s in g["samples"]] for g in groups]
        assert responses == first["responses"] + second["responses"] + third["responses"]
    assert calls[1][0]["seed"] != calls[1][1]["seed"]

    # Both engines started from the checkpoint and took every push: the same greedy outputs, changed by training.
    probes = [[record["outputs"] for record in read_records(records, engine, "probe")] for engine in (0, 1)]
    assert [len(engine_probes) for engine_probes in probes] == [1 + NUM_STEPS, 1 + NUM_STEPS]
    for on_engine_0, on_engine_1 in zip(*probes):
        assert_same_generations(on_engine_0, on_engine_1)
    for step in range(NUM_STEPS):
        assert largest_logprob_change(probes[0][step], probes[0][step + 1]) > 1e-3, f"step {step} changed nothing"

    leftover = leftover_processes(marker)
    assert not leftover, f"processes left behind by the run: {describe(leftover)}"
