"""Steps on a long-tailed rollout: the real `relax train` job (SGLang engine, Megatron actor, local Ray) run once
per rollout mode on the same model, prompts and sizes, in one run of this script.

    .venv/bin/python benchmarks/rollout_long_tail.py --out long_tail.json                  # CPU, a few minutes
    python3 benchmarks/rollout_long_tail.py --device cuda --out long_tail.json             # GPU (docs/benchmarks.md)

The modes (MODES: the `relax train` flags each adds to the common ones):
    sync           the default rollout: each step waits for its slowest group
    over_sampling  --over-sampling-batch-size (default 2 x --rollout-batch-size): the step takes the first groups
                   to complete, aborts the rest and puts their prompts back
    partial        over_sampling with --partial-rollout: the aborted groups go back with what they generated, and
                   the next step continues them
    async          --no-colocate --rollout-num-devices D: the engines on D devices of their own (Ray bundles on the
                   CPU) generate the next step's rollout while the actor trains on D; the other modes share D
    async_beside   --no-colocate --rollout-num-devices 0: as async, the engines beside the actor on its D devices
                   (both resident: one GPU runs it, the engines' memory share set by --sglang-mem-fraction-static)

The long tail comes from the model. The benchmark builds a random Qwen3-shaped checkpoint (relax.tools.tiny_model,
its character tokenizer of 56 tokens), then rewrites three kinds of its weights so that the model, at temperature
1, samples from a chosen Markov chain over tokens while every layer still computes at full size: each attention
output projection and MLP down projection is zero (the residual stream stays the input token's embedding), the
embedding of token t is the unit vector e_t, so the final norm gives sqrt(hidden) e_t, and the output head's
column t holds the logits of the token after t (transition_logits). The chain: the tokens of the alphabet but the
prompt's last character (":", which every copy_digit prompt ends with) form --regimes equal groups (the few left
over, like the prompt's tokens, only start the chain); after ":" the first response token is uniform over the
groups' tokens, so it picks a group; within a group each token is followed by
one of the group's tokens or by EOS, with group r's stop probability 1/m_r per token. Response lengths are then
a mixture of geometric distributions, 1 + Geometric(1/m_r) with each group equally likely, with m_r = scale x
exp(--regime-sigma x z_r) (z_r the standard normal's quantiles at (r + 0.5) / regimes) and the scale solved so
that the mixture's median is --median-response: with --regime-sigma 0.5 its quantiles over the median (p90 3.9x,
p99 9.5x, mean 1.7x, simulated) are close to a lognormal's of log standard deviation 1 (3.6x, 10.1x, 1.6x), the
distribution rl_batch_throughput.py draws; --regime-sigma 0 gives one geometric. Responses are clipped at
--max-response. The reward is copy_digit's (the samples are junk to it). The learning rate is 0: every step still
computes the gradients, runs the optimizer and pushes the weights, but the chain stays as built. (At 1e-6 it did
not, likely because Adam's first step moves every weight a gradient reaches by about the learning rate, whatever the
gradient's size: the embedding of a token
gains ~1e-6 in each of its zero entries, and the output head, whose entries are mostly -40, turns that into logit
shifts of order 1 at a hidden size of 1024. On the H100 at 1e-6 the sync run's median length went from 223 tokens
at step 0 to 7 at step 1 and 2048 at step 2.)

Per mode, over the steps after the first that ran a rollout (async's last step generates nothing, and every
mode's first step includes warm-ups), from the run's output/metrics.jsonl: each step's perf/step_time and their
median; trained samples per second (--rollout-batch-size x --n-samples-per-prompt x the steps, over the steps'
summed perf/step_time); the rollout's share of the
time (the sum of perf/rollout_time over the sum of perf/step_time; under async the rollout runs beside the
training); the mean aborted groups per step; each phase's median seconds (the perf/*_time keys). The trained
samples' response lengths (median, p90, p99, max, mean, share at --max-response) are read from the run's
--save-rollout-data files of every step (written inside the timed rollout), with the 1-minute load average before
and after the run. Last, each mode's step time and samples per second over sync's.
"""

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    "tiny": {},  # relax.tools.tiny_model's own: 2 layers, hidden 64
    # Qwen3-0.6B's body (config.json of the released model), untied: the output head is the chain's own
    "qwen3_0_6b": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
}
DEVICE_DEFAULTS = {  # what --device sets unless given
    "cpu": dict(shape="tiny", rollout_batch_size=8, median_response=48, max_response=384, num_steps=8,
                max_tokens_per_device=4096),
    "cuda": dict(shape="qwen3_0_6b", rollout_batch_size=32, median_response=256, max_response=2048, num_steps=4,
                 max_tokens_per_device=16384),
}
DEVICE_FLAGS = {"cpu": [], "cuda": ["--bf16"]}
MODES = {  # name: the `relax train` flags it adds (a new mode is one more entry)
    "sync": lambda args: [],
    "over_sampling": lambda args: ["--over-sampling-batch-size", str(args.over_sampling_batch_size)],
    "partial": lambda args: [*MODES["over_sampling"](args), "--partial-rollout"],
    "async": lambda args: ["--no-colocate", "--rollout-num-devices", str(args.devices)],
    "async_beside": lambda args: ["--no-colocate", "--rollout-num-devices", "0"],
}
PROMPT_END = ":"  # the last character of every copy_digit prompt: the chain's start
NEVER = -40.0  # the logit of a token the chain never samples
PROMPT_ROOM = 16  # positions for the prompt (copy_digit's are 7 tokens) beyond --max-response


def regime_means(args) -> list[float]:
    """m_r = scale x exp(sigma z_r), the scale such that the median response length is --median-response."""
    from statistics import NormalDist

    shapes = [math.exp(args.regime_sigma * NormalDist().inv_cdf((r + 0.5) / args.regimes)) for r in range(args.regimes)]
    low, high = 1e-3, 1e6  # bisection on the scale, in log space
    for _ in range(100):
        scale = math.sqrt(low * high)
        if length_cdf(args.median_response, [scale * s for s in shapes]) < 0.5:  # too long
            high = scale
        else:
            low = scale
    return [scale * s for s in shapes]


def length_cdf(length: int, means: list[float]) -> float:
    """P(response length <= length): the first token, then Geometric(1/m) tokens up to and including EOS, the group
    of mean m equally likely."""
    return statistics.fmean(1 - (1 - min(1.0, 1 / m)) ** max(0, length - 1) for m in means)


def transition_logits(tokenizer, means: list[float]):
    """[vocabulary, vocabulary]: row t the logits of the token after t (the chain of the module doc)."""
    import torch

    from relax.tools.tiny_model import ALPHABET

    eos = tokenizer.eos_token_id
    alphabet = [tokenizer.encode(c, add_special_tokens=False)[0] for c in ALPHABET if c != PROMPT_END]
    size = len(alphabet) // len(means)
    if size < 1:
        raise ValueError(f"--regimes {len(means)}: more groups than the {len(alphabet)} tokens to share among them; "
                         f"give at most {len(alphabet)}")
    groups = [alphabet[r * size : (r + 1) * size] for r in range(len(means))]
    vocabulary = len(tokenizer)
    logits = torch.full((vocabulary, vocabulary), NEVER)
    every_group = [t for group in groups for t in group]
    logits[:, every_group] = 0.0  # tokens in no group (the prompt's) start the chain: any group's token
    for group, mean in zip(groups, means):
        stop = min(1 / mean, 1 - 1e-6)
        for t in group:
            logits[t] = NEVER
            logits[t, group] = 0.0
            logits[t, eos] = math.log(stop * len(group) / (1 - stop))  # P(EOS) = stop against the group's tokens
    return logits


def build_chain_model(out_dir: Path, args) -> Path:
    """The random checkpoint with the chain's weights written in (module doc)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from relax.tools.tiny_model import build_tiny_model

    cuda = args.device == "cuda"
    shape = {**SHAPES[args.shape], "max_position_embeddings": args.max_response + PROMPT_ROOM}
    build_tiny_model(out_dir, "qwen3", device=args.device, dtype=torch.bfloat16 if cuda else torch.float32, **shape)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    weights_file = out_dir / "model.safetensors"
    tensors = load_file(weights_file)
    embedding, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    vocabulary, hidden = embedding.shape
    if hidden < vocabulary:
        raise ValueError(f"--shape {args.shape}: hidden size {hidden} is less than the vocabulary ({vocabulary})")
    for name, tensor in tensors.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor.zero_()
    embedding.zero_()
    embedding[:, :vocabulary] = torch.eye(vocabulary)
    head.zero_()
    head[:, :vocabulary] = transition_logits(tokenizer, regime_means(args)).T / math.sqrt(hidden)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    return out_dir


def train_command(mode: str, model: Path, data: Path, run_dir: Path, args) -> list[str]:
    samples_per_step = args.rollout_batch_size * args.n_samples_per_prompt
    return [
        sys.executable, "-m", "relax.cli", "train",
        "--device", args.device, *DEVICE_FLAGS[args.device], "--hf-checkpoint", str(model),
        "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label", "--reward-fn", "copy_digit",
        "--num-steps", str(args.num_steps), "--rollout-batch-size", str(args.rollout_batch_size),
        "--n-samples-per-prompt", str(args.n_samples_per_prompt), "--rollout-max-response-len", str(args.max_response),
        "--rollout-temperature", "1.0", "--global-batch-size", str(samples_per_step), "--micro-batch-size", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-device", str(args.max_tokens_per_device),
        "--advantage-estimator", "grpo", "--lr", "0", "--weight-decay", "0.0",
        "--num-nodes", "1", "--num-devices-per-node", str(args.devices),
        "--output-dir", str(run_dir / "output"), "--overwrite-output-dir",
        "--save-rollout-data", str(run_dir / "rollouts" / "step_{step}.jsonl"),
        *MODES[mode](args), *shlex.split(args.train_flags),
    ]


def response_lengths(rollouts: Path) -> list[int]:
    """Every trained sample's response length, from a run's --save-rollout-data files."""
    lengths = []
    for path in sorted(rollouts.glob("step_*.jsonl")):
        for line in path.read_text().splitlines()[1:]:  # the first line is the header
            lengths += [len(sample["response_token_ids"]) for sample in json.loads(line)["samples"]]
    return lengths


def quantile(values: list[int], q: float) -> int:
    """The smallest value with at least a share q of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def length_summary(lengths: list[int], max_response: int) -> dict:
    return {
        "median": quantile(lengths, 0.5), "p90": quantile(lengths, 0.9), "p99": quantile(lengths, 0.99),
        "max": max(lengths), "mean": statistics.fmean(lengths),
        "at_max_share": sum(n >= max_response for n in lengths) / len(lengths), "samples": len(lengths),
    }


def mode_summary(records: list[dict], samples_per_step: int) -> dict:
    """The figures of the module doc from a run's metrics rows."""
    steady = [r for r in records if r.get("step", 0) >= 1 and "perf/rollout_time" in r and "perf/step_time" in r]
    if not steady:
        raise ValueError("no step after the first ran a rollout: give --num-steps 3 or more")
    step_times = [r["perf/step_time"] for r in steady]
    measured_time = sum(step_times)
    return {
        "steps_measured": len(steady),
        "step_times_s": step_times,
        "step_time_median_s": statistics.median(step_times),
        # over the measured steps' whole time, not a typical step: partial rollout's steps differ by design (one
        # finishes groups an earlier step carried), so its throughput is the run's
        "trained_samples_per_s": samples_per_step * len(steady) / measured_time,
        "rollout_share": sum(r["perf/rollout_time"] for r in steady) / measured_time,
        "aborted_groups_per_step": statistics.fmean(r.get("rollout/aborted_groups", 0.0) for r in steady),
        # where the step goes: each phase's median seconds (perf/rollout_time, perf/train_time, ...)
        "phase_medians_s": {
            key.removeprefix("perf/"): statistics.median(r[key] for r in steady)
            for key in sorted(steady[0])
            if key.startswith("perf/") and key.endswith("_time") and key != "perf/step_time"
            and all(key in r for r in steady)
        },
    }


def run_mode(mode: str, model: Path, data: Path, args) -> dict:
    from relax.run.metrics import read_metrics

    run_dir = Path(args.work_dir) / mode
    command = train_command(mode, model, data, run_dir, args)
    run_dir.mkdir(parents=True, exist_ok=True)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    with (run_dir / "console.log").open("w") as console:
        finished = subprocess.run(command, stdout=console, stderr=subprocess.STDOUT)
    if finished.returncode:
        raise SystemExit(f"{mode}: `relax train` failed ({finished.returncode}); see {run_dir / 'console.log'}")
    records = read_metrics(run_dir / "output" / "metrics.jsonl")
    return {
        "command": shlex.join(command),
        "wall_s": time.perf_counter() - started,
        "load_average_1min": [load_before, os.getloadavg()[0]],  # before and after: the machine may be shared
        **mode_summary(records, args.rollout_batch_size * args.n_samples_per_prompt),
        "response_lengths": length_summary(response_lengths(run_dir / "rollouts"), args.max_response),
    }


def print_table(results: dict) -> None:
    print(f"{'mode':<14} {'step s (median)':>15} {'samples/s':>10} {'rollout share':>13} {'aborted/step':>12} "
          f"{'len median/p90/p99/max':>23} {'len mean':>8}")
    for mode, r in results.items():
        lengths = r["response_lengths"]
        spread = f"{lengths['median']}/{lengths['p90']}/{lengths['p99']}/{lengths['max']}"
        print(f"{mode:<14} {r['step_time_median_s']:>15.3f} {r['trained_samples_per_s']:>10.2f} "
              f"{r['rollout_share']:>13.1%} {r['aborted_groups_per_step']:>12.1f} {spread:>23} {lengths['mean']:>8.1f}")


def ratios_to_sync(results: dict) -> dict:
    sync = results["sync"]
    return {
        mode: {
            "step_time": r["step_time_median_s"] / sync["step_time_median_s"],
            "trained_samples_per_s": r["trained_samples_per_s"] / sync["trained_samples_per_s"],
        }
        for mode, r in results.items() if mode != "sync"
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=sorted(DEVICE_DEFAULTS), default="cpu", help="sets the defaults below")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="cpu: tiny, cuda: qwen3_0_6b")
    parser.add_argument("--rollout-batch-size", type=int, help="prompts per step (cpu: 8, cuda: 32)")
    parser.add_argument("--n-samples-per-prompt", type=int, default=8)
    parser.add_argument("--over-sampling-batch-size", type=int, help="over_sampling's (default 2 x batch)")
    parser.add_argument("--median-response", type=int, help="median response length (cpu: 48, cuda: 256)")
    parser.add_argument("--regime-sigma", type=float, default=0.5, help="log spread of the groups' mean lengths")
    parser.add_argument("--regimes", type=int, default=8, help="groups of tokens, each its own stop probability")
    parser.add_argument("--max-response", type=int, help="--rollout-max-response-len (cpu: 384, cuda: 2048)")
    parser.add_argument("--max-tokens-per-device", type=int, help="the actor's micro-batch budget (cpu: 4096)")
    parser.add_argument("--num-steps", type=int, help="steps per mode (cpu: 8, cuda: 4)")
    parser.add_argument("--devices", type=int, default=1, help="the actor's devices (and async's engines')")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--train-flags", default="", help="more `relax train` flags for every mode, one string")
    parser.add_argument("--work-dir", default="/tmp/relax_rollout_long_tail")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    for name, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = 2 * args.rollout_batch_size
    if args.over_sampling_batch_size <= args.rollout_batch_size:
        parser.error("--over-sampling-batch-size must be more than --rollout-batch-size, or over_sampling is sync")
    for flag in ("rollout_batch_size", "n_samples_per_prompt", "regimes", "devices"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.regime_sigma < 0:
        parser.error("--regime-sigma must be 0 (one geometric distribution) or more")
    if args.num_steps < 3:
        parser.error("--num-steps must be at least 3: the first step is not measured, nor async's last")
    if not 1 < args.median_response < args.max_response:
        parser.error("--median-response must be more than 1 and less than --max-response")
    if args.max_tokens_per_device < args.max_response + PROMPT_ROOM:
        parser.error("--max-tokens-per-device must hold the longest sample: at least --max-response + 16")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from relax.rollout.synthetic import write_task

    work = Path(args.work_dir)
    model = build_chain_model(work / "model", args)
    # Enough prompts for every step's submissions, aborted ones put back and taken again.
    data = write_task("copy_digit", 4 * args.num_steps * args.over_sampling_batch_size, work / "prompts.jsonl")
    print(f"{args.device}, --shape {args.shape}, {args.rollout_batch_size} prompts x {args.n_samples_per_prompt} "
          f"samples, median response {args.median_response}, --regime-sigma {args.regime_sigma}, "
          f"max {args.max_response}, {args.num_steps} steps per mode", flush=True)
    results = {}
    for mode in args.modes:
        results[mode] = run_mode(mode, model, data, args)
        print(mode, json.dumps(results[mode]), flush=True)
    print_table(results)
    ratios = ratios_to_sync(results) if "sync" in results else {}
    for mode, ratio in ratios.items():
        print(f"{mode} / sync: step time {ratio['step_time']:.2f}, trained samples per second "
              f"{ratio['trained_samples_per_s']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "modes": results, "over_sync": ratios}, indent=1))


if __name__ == "__main__":
    main()
