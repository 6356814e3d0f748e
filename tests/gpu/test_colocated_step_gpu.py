"""The colocated step on one CUDA GPU: relax.run.loop.run, whole, on its own local Ray cluster, with SGLang's real
engine and the Megatron actor sharing the device, on a Qwen3-1.7B-shaped model (28 layers, hidden 2048, FFN 6144,
16 query / 8 KV heads of 128: 1.4B parameters; random bf16 weights and relax's tiny tokenizer, so the vocabulary
is 64 tokens) built on the device. Every step: generate -> release -> wake -> train -> push over CUDA IPC ->
sleep (torch_memory_saver) -> resume.

Checked by effect: after every push the engine greedy-decodes probe prompts; the actor saves the weights it
pushed as an HF directory; after the run, HF transformers (fp32) scores the engine's tokens teacher-forced under
each step's saved weights: the engine's logprobs equal HF's within bf16 noise, its tokens are HF's argmax
wherever HF's top two are apart by more than that noise, and they are closer to the weights just pushed than to
the previous step's (so the push took effect, not only returned).

Run once per --actor-sleep-route. Measured in the same run (written to
$RELAX_GPU_REPORT_DIR/colocated_step_<route>.json; docs/benchmarks.md holds the figures): device memory in use (NVML, the whole device) at each point of the switch, each phase's
seconds, the push's GB/s against a device-to-device copy of the same bytes, and sleep / wake through
torch_memory_saver against relax's host-copy route (relax.train.offload.HostCopies) on the same training state.

Needs the GPU verification bundle (docs/gpu-verification.md); on the lent H200:
    source tests/gpu/bundle/enter.sh && python3 -m pytest -q -s tests/gpu/test_colocated_step_gpu.py
"""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        any(importlib.util.find_spec(name) is None for name in ("megatron", "sglang", "ray", "pynvml")),
        reason="needs megatron-core, sglang, ray and nvidia-ml-py (the GPU verification bundle)",
    ),
]

RECORDS_ENV = "RELAX_TEST_GPU_RECORDS"  # the directory the workers write their events to
PROBE_PROMPTS = [[5, 6, 7], [1, 33, 31, 17, 30, 54, 15], [12, 40, 9, 9, 2], [3] * 11]
PROBE_TOKENS = 16
NUM_STEPS, PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, MAX_RESPONSE = 3, 32, 8, 256
# bf16 engine against fp32 HF through 28 random layers: the largest logprob gap seen is the tolerance's scale.
LOGPROB_TOLERANCE = 0.1


def device_memory_used_gib() -> float:
    """The whole device's memory in use, as NVML reports it (every process's, without creating a CUDA context)."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used / 2**30


def write_event(role: str, event: str, **values) -> None:
    record = {"role": role, "event": event, "time": time.time(), "device_used_gib": device_memory_used_gib(), **values}
    with (Path(os.environ[RECORDS_ENV]) / f"{role}.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


def timed(role: str, event: str, call, **values):
    start = time.perf_counter()
    result = call()
    write_event(role, event, seconds=time.perf_counter() - start, **values)
    return result


def alternating_reward(samples):
    """1, 0, 1, 0, ... over a step's samples (n consecutive per prompt, n even): every group has advantages, so
    every step changes the weights, which a random model's task reward does not promise."""
    return [float(i % 2) for i in range(len(samples))]


def _measured_workers():
    """The loop's worker classes with measurements and probes (defined here so that Ray pickles them by value)."""
    from relax.rollout.engine import SamplingConfig
    from relax.rollout.worker import EngineWorker
    from relax.train.worker import TrainWorker

    greedy = SamplingConfig(temperature=0.0, max_new_tokens=PROBE_TOKENS, ignore_eos=True)

    class MeasuredEngineWorker(EngineWorker):
        def __init__(self, *args):
            timed("engine", "start", lambda: super(MeasuredEngineWorker, self).__init__(*args))
            self._probe()

        def generate(self, prompts, sampling, prefixes=None):
            completions = timed("engine", "generate",
                                lambda: super(MeasuredEngineWorker, self).generate(prompts, sampling, prefixes))
            new_tokens = sum(len(c.token_ids) for group in completions for c in group)
            write_event("engine", "generated", new_tokens=new_tokens, samples=sum(map(len, completions)))
            return completions

        def release_memory_occupation(self, tags):
            timed("engine", "release", lambda: super(MeasuredEngineWorker, self).release_memory_occupation(tags), tags=list(tags))

        def resume_memory_occupation(self, tags):
            timed("engine", "resume", lambda: super(MeasuredEngineWorker, self).resume_memory_occupation(tags), tags=list(tags))
            if "kv_cache" in tags:  # the end of a weight push (relax.run.colocation.Colocation.to_engines)
                self._probe()

        def _probe(self):
            outputs = [(c.token_ids, c.logprobs) for (c,) in EngineWorker.generate(self, PROBE_PROMPTS, greedy)]
            write_event("engine", "probe", outputs=outputs)

    class MeasuredTrainWorker(TrainWorker):
        def __init__(self, *args):
            super().__init__(*args)
            self.pushes = 0

        def wake(self):
            timed("actor", "wake", super().wake)

        def sleep(self):
            timed("actor", "sleep", super().sleep)

        def train(self, batch, step_sizes, with_reference):
            torch.cuda.reset_peak_memory_stats()
            metrics = timed("actor", "train", lambda: super(MeasuredTrainWorker, self).train(batch, step_sizes, with_reference))
            write_event("actor", "trained", peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                        tokens=sum(len(t) for t in batch.tokens))
            return metrics

        def push_weights(self, engines, engine_tp_size, engine_nodes, kill_after_first_bucket=None):
            if self.pushes == 0:  # the training state is whole (Adam's moments exist after the first step)
                self._time_host_copies()
            torch.cuda.reset_peak_memory_stats()
            report = timed("actor", "push", lambda: super(MeasuredTrainWorker, self).push_weights(
                engines, engine_tp_size, engine_nodes, kill_after_first_bucket))
            write_event("actor", "pushed", bytes=report["bytes"], routes=report["routes"],
                        peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                        copy_seconds=self._device_copy_seconds(report["bytes"]))
            # The weights just pushed, for the HF check after the run (not a phase of the loop).
            self.save_hf(str(Path(os.environ[RECORDS_ENV]) / f"pushed_{self.pushes}"))
            self.pushes += 1
            return report

        def _device_copy_seconds(self, num_bytes: int) -> float:
            """A device-to-device copy of the pushed bytes: the bound the push is measured against."""
            source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
            target = torch.empty_like(source)
            target.copy_(source)
            torch.cuda.synchronize()
            start = time.perf_counter()
            target.copy_(source)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            del source, target
            torch.cuda.empty_cache()
            return seconds

        def _time_host_copies(self):
            """The byte movement of relax's host-copy route (relax.train.offload.HostCopies, the CPU's) on this
            training state: every distinct storage to pinned host memory and back. Not the route itself, which
            would regrow the storages outside the memory saver's region."""
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in self.actor._training_state_tensors()
                        if t.is_cuda}
            views = [torch.empty(0, dtype=torch.uint8, device="cuda").set_(s) for s in storages.values()]
            host = [torch.empty(v.numel(), dtype=torch.uint8, pin_memory=True) for v in views]
            start = time.perf_counter()
            for h, v in zip(host, views):
                h.copy_(v, non_blocking=True)
            torch.cuda.synchronize()
            to_host = time.perf_counter() - start
            for h, v in zip(host, views):
                v.copy_(h, non_blocking=True)
            torch.cuda.synchronize()
            write_event("actor", "host_copies", state_bytes=sum(v.numel() for v in views), to_host_seconds=to_host,
                        to_device_seconds=time.perf_counter() - start - to_host)

    return MeasuredEngineWorker, MeasuredTrainWorker


def read_events(records: Path, role: str) -> list[dict]:
    return [json.loads(line) for line in (records / f"{role}.jsonl").read_text().splitlines()]


def hf_teacher_forced(model_dir: Path, outputs) -> list[tuple[list[float], list[float], list[int]]]:
    """Per probe: HF's (fp32) logprob of each engine token, its top logprob and its argmax at each position."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    scored = []
    with torch.no_grad():
        for prompt, (tokens, _) in zip(PROBE_PROMPTS, outputs, strict=True):
            ids = torch.tensor([prompt + tokens], device="cuda")
            logprobs = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
            chosen = logprobs.gather(1, ids[0, len(prompt):, None])[:, 0]
            scored.append((chosen.tolist(), logprobs.max(-1).values.tolist(), logprobs.argmax(-1).tolist()))
    del model
    torch.cuda.empty_cache()
    return scored


def gaps_to(scored, outputs) -> list[float]:
    return [abs(hf - engine) for (hf_lp, _, _), (_, engine_lp) in zip(scored, outputs) for hf, engine in zip(hf_lp, engine_lp)]


def _config(tmp_path: Path, sleep_route: str, *flags: str):
    """The run's settings, on a Qwen3-1.7B-shaped model and copy_digit prompts written under tmp_path."""
    from relax.args import parse_train_args
    from relax.rollout.synthetic import write_task
    from relax.tools.tiny_model import QWEN3_1_7B_BODY, build_tiny_model

    model = build_tiny_model(tmp_path / "model", "qwen3", device="cuda", dtype=torch.bfloat16, **QWEN3_1_7B_BODY)
    data = write_task("copy_digit", 200, tmp_path / "copy_digit.jsonl")
    return model, parse_train_args([
        "--device", "cuda", "--hf-checkpoint", str(model),
        "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--reward-fn", f"{__name__}:alternating_reward",
        "--num-steps", str(NUM_STEPS), "--rollout-batch-size", str(PROMPTS_PER_STEP),
        "--n-samples-per-prompt", str(SAMPLES_PER_PROMPT), "--rollout-max-response-len", str(MAX_RESPONSE),
        "--rollout-temperature", "1.0",
        "--global-batch-size", str(PROMPTS_PER_STEP * SAMPLES_PER_PROMPT), "--micro-batch-size", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-device", "16384",
        "--bf16", "--lr", "1e-3", "--weight-decay", "0.0", "--clip-grad", "1.0",
        "--num-nodes", "1", "--num-devices-per-node", "1", "--rollout-num-devices-per-engine", "1",
        "--sglang-attention-backend", "triton", "--sglang-sampling-backend", "pytorch",
        "--sglang-mem-fraction-static", "0.6", "--sglang-disable-prefill-cuda-graph",
        "--actor-sleep-route", sleep_route, "--output-dir", str(tmp_path / "output"), *flags,
    ])


@pytest.mark.parametrize("sleep_route", ["memory-saver", "host-copies"])
def test_colocated_steps_on_one_gpu_push_weights_that_generate_as_hf_does(sleep_route, tmp_path, monkeypatch):
    import ray

    import relax.run.loop
    from relax.run.inputs import read_inputs

    records = tmp_path / "records"
    records.mkdir()
    model, config = _config(tmp_path, sleep_route)
    engine_class, trainer_class = _measured_workers()
    monkeypatch.setenv(RECORDS_ENV, str(records))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(relax.run.loop, "EngineWorker", engine_class)
    monkeypatch.setattr(relax.run.loop, "TrainWorker", trainer_class)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the Ray workers cannot import this file
    start = time.perf_counter()
    try:
        relax.run.loop.run(config, read_inputs(config))
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    run_seconds = time.perf_counter() - start

    metrics = [json.loads(line) for line in (tmp_path / "output" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(NUM_STEPS))
    assert all(m["train/update_successful"] == 1.0 for m in metrics)
    engine, actor = read_events(records, "engine"), read_events(records, "actor")
    probes = [e["outputs"] for e in engine if e["event"] == "probe"]
    assert len(probes) == 1 + NUM_STEPS  # at start and after every push

    checks = []
    previous = hf_teacher_forced(model, probes[0])
    assert max(gaps_to(previous, probes[0])) < LOGPROB_TOLERANCE  # the engine loaded the checkpoint as HF does
    for step in range(NUM_STEPS):
        outputs = probes[step + 1]
        pushed = hf_teacher_forced(records / f"pushed_{step}", outputs)
        gaps, gaps_before = gaps_to(pushed, outputs), gaps_to(previous, outputs)
        argmax_misses = [
            (probe, position)
            for probe, ((chosen, top, _), (tokens, _)) in enumerate(zip(pushed, outputs))
            for position, (lp, best) in enumerate(zip(chosen, top))
            if best - lp > LOGPROB_TOLERANCE  # HF prefers another token by more than bf16 noise
        ]
        checks.append({"step": step, "max_gap_to_pushed": max(gaps), "mean_gap_to_pushed": sum(gaps) / len(gaps),
                       "mean_gap_to_previous": sum(gaps_before) / len(gaps_before), "argmax_misses": len(argmax_misses)})
        assert max(gaps) < LOGPROB_TOLERANCE, checks[-1]
        assert not argmax_misses, checks[-1]
        assert sum(gaps) < sum(gaps_before), checks[-1]  # the push took effect
        previous = pushed

    report = {
        "run_seconds": run_seconds, "metrics": metrics, "checks": checks,
        "engine_events": [{k: v for k, v in e.items() if k != "outputs"} for e in engine],
        "actor_events": actor,
    }
    report_dir = Path(os.environ.get("RELAX_GPU_REPORT_DIR", "."))
    (report_dir / f"colocated_step_{sleep_route}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({"checks": checks, "run_seconds": run_seconds}))


# The engine's scheduler SIGKILLed after the first bucket of step 0's weight push and as step 2's rollout begins
# (relax.ray.faults).
INJECTED_FAULTS = "push@0=scheduler,rollout@2=scheduler"


def test_an_engine_killed_mid_push_and_at_a_rollout_restarts_in_place_on_one_gpu(tmp_path, monkeypatch):
    """relax.run.colocation on the GPU: each time, the new engine starts with the device to itself (the actor
    asleep), is brought to its phase's memory state, gets the actor's weights, and the step goes on. Its seconds are
    written to $RELAX_GPU_REPORT_DIR/colocated_step_faults.json (docs/benchmarks.md)."""
    import relax.run.loop
    from relax.run.inputs import read_inputs

    # Half the micro-batch token budget of the other test: the actor peaks lower (its activations), so the test
    # fits an 80 GB H100 too; the restarts do not depend on it.
    _, config = _config(tmp_path, "memory-saver", "--max-engine-restarts", "2", "--max-tokens-per-device", "8192")
    monkeypatch.setenv("RELAX_INJECT_FAULTS", INJECTED_FAULTS)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    start = time.perf_counter()
    relax.run.loop.run(config, read_inputs(config))
    run_seconds = time.perf_counter() - start

    metrics = [json.loads(line) for line in (tmp_path / "output" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(NUM_STEPS))
    assert [m["faults/engine_restarts"] for m in metrics] == [1, 0, 1]
    assert all(m["train/update_successful"] == 1.0 for m in metrics)
    assert all(m["rollout/response_tokens"] > 0 for m in metrics)
    report = {
        "faults": INJECTED_FAULTS, "run_seconds": run_seconds,
        "steps": [{k: m[k] for k in ("step", "faults/engine_restarts", "faults/engine_restart_seconds",
                                      "perf/step_time", "perf/rollout_time", "perf/weight_sync_time")}
                  for m in metrics],
    }
    report_dir = Path(os.environ.get("RELAX_GPU_REPORT_DIR", "."))
    (report_dir / "colocated_step_faults.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
