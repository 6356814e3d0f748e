"""Qwen3.5 inside SGLang's engine on one CUDA GPU, in one run: the GDN layers' decode through SGLang's own kernels
against relax's fused decode kernel (patches/sglang 0004, SGLANG_RELAX_FUSED_GDN_DECODE=1;
relax.rollout.sglang_gdn_decode), each in its own engine through relax.rollout.engine.RolloutEngine.

The model: relax.tools.tiny_model's qwen3_5 family with Qwen3.5-9B's layer shapes (its qwen3_5_9b_layers:
hidden 4096; GDN layers of 16 key and 32 value heads of 128, conv width 4; full-attention layers of 16 query / 4 KV
heads of 256; FFN 12288), 8 layers (3 GDN, 1 full attention, twice), random bf16 weights built on the device,
relax's tiny tokenizer.

Prints, per side: the greedy tokens of 8 probe prompts (the two sides must agree: the run fails otherwise) and, at
each batch size, with decode CUDA graphs on:
- the decode step's wall time, (time to generate 1 + --steps tokens - time to generate 1) / --steps: what a user
  waits, which at these sizes is mostly SGLang's scheduler on the host, so it moves by milliseconds between runs;
- the decode step's GPU time: the durations of every kernel the GPU ran (SGLang's torch profiler, CUPTI) for
  1 + --profile-steps new tokens minus those for 1, over --profile-steps. The two sides run the same kernels but
  for the GDN layers' decode, so the difference is the GDN decode's.
Then relax's speed-up per batch in both. Needs the GPU verification bundle with relax's patch
sets applied (docs/gpu-verification.md):
    source tests/gpu/bundle/enter.sh && python3 benchmarks/qwen35_decode_gpu.py
"""

import argparse
import glob
import gzip
import json
import os
import tempfile
import time

import torch

SWITCH = "SGLANG_RELAX_FUSED_GDN_DECODE"
SERVER_FIELDS = dict(
    attention_backend="triton", sampling_backend="pytorch", disable_prefill_cuda_graph=True,
    mem_fraction_static=0.7, cuda_graph_max_bs_decode=256, log_level="warning",
)


def measure(model_dir: str, fused: bool, args) -> dict:
    from relax.platform import get_platform
    from relax.rollout.engine import RolloutEngine, SamplingConfig

    os.environ[SWITCH] = "1" if fused else "0"  # read by the engine's scheduler process when it imports the model
    generator = torch.Generator().manual_seed(0)
    with RolloutEngine(dict(SERVER_FIELDS), model_path=model_dir, platform=get_platform("cuda")) as engine:
        probes = torch.randint(3, 60, (8, 16), generator=generator).tolist()
        greedy = engine.generate(probes, SamplingConfig(temperature=0.0, max_new_tokens=32, ignore_eos=True))
        step_ms, gpu_step_ms = {}, {}
        for batch in args.batches:
            prompts = torch.randint(3, 60, (batch, 32), generator=generator).tolist()

            def seconds(new_tokens):
                sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
                engine.flush_cache()  # every prompt is prefilled anew
                start = time.perf_counter()
                engine.generate(prompts, sampling)
                return time.perf_counter() - start

            def kernel_seconds(new_tokens):
                """The summed duration of the kernels the GPU ran while generating `new_tokens` per prompt."""
                sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
                engine.flush_cache()
                with tempfile.TemporaryDirectory() as trace_dir:
                    with engine.profiled(trace_dir):
                        engine.generate(prompts, sampling)
                    return sum_kernel_seconds(trace_dir)

            seconds(args.steps + 1)  # warm-up at this batch
            prefill = min(seconds(1) for _ in range(3))
            whole = min(seconds(args.steps + 1) for _ in range(3))
            step_ms[batch] = (whole - prefill) / args.steps * 1e3
            gpu_step_ms[batch] = (kernel_seconds(args.profile_steps + 1) - kernel_seconds(1)) / args.profile_steps * 1e3
    return {"side": "relax_fused" if fused else "sglang", "greedy": [c.token_ids for (c,) in greedy],
            "decode_step_ms": step_ms, "decode_step_gpu_ms": gpu_step_ms}


def sum_kernel_seconds(trace_dir: str, wait_s: float = 60.0) -> float:
    """The summed kernel durations of the one Chrome trace SGLang's profiler writes into trace_dir (its scheduler
    writes it after stop_profile returns: waits for it)."""
    deadline = time.monotonic() + wait_s
    while True:
        traces = glob.glob(f"{trace_dir}/**/*.json*", recursive=True)
        if traces:
            try:
                opener = gzip.open if traces[0].endswith(".gz") else open
                with opener(traces[0], "rt") as trace:
                    events = json.load(trace)["traceEvents"]
                return sum(event["dur"] for event in events if event.get("cat") == "kernel") / 1e6
            except (EOFError, json.JSONDecodeError):  # still being written
                pass
        if time.monotonic() > deadline:
            raise SystemExit(f"SGLang's profiler wrote no readable trace into {trace_dir} in {wait_s:.0f} s")
        time.sleep(0.5)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=128, help="decode steps timed per batch (wall time)")
    parser.add_argument("--profile-steps", type=int, default=32, help="decode steps profiled per batch (GPU time)")
    args = parser.parse_args()

    from relax.tools.tiny_model import build_tiny_model, qwen3_5_9b_layers

    with tempfile.TemporaryDirectory() as directory:
        model_dir = str(build_tiny_model(
            directory, "qwen3_5", device="cuda", dtype=torch.bfloat16, **qwen3_5_9b_layers(8)
        ))
        torch.cuda.empty_cache()
        sides = [measure(model_dir, fused, args) for fused in (False, True)]
    for side in sides:
        print(json.dumps(side), flush=True)
    sglang, relax = sides
    same = sglang["greedy"] == relax["greedy"]
    print(json.dumps({
        "same_greedy_tokens": same,
        "relax_speedup_wall": {b: sglang["decode_step_ms"][b] / relax["decode_step_ms"][b] for b in args.batches},
        "relax_speedup_gpu": {
            b: sglang["decode_step_gpu_ms"][b] / relax["decode_step_gpu_ms"][b] for b in args.batches
        },
    }))
    if not same:
        raise SystemExit("the fused decode changed the greedy tokens")


if __name__ == "__main__":
    main()
