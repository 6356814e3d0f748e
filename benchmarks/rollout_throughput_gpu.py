"""Rollout throughput on one CUDA GPU, in one run (benchmarks/rollout_throughput.py is the CPU one): relax's
engine (relax.rollout.engine.RolloutEngine, what the loop's engine workers call) against bare SGLang (sglang.Engine
with the same server arguments and the same requests) and HF transformers' generate, on a Qwen3-1.7B-shaped model
(relax.tools.tiny_model.QWEN3_1_7B_BODY; random bf16 weights, relax's 64-token tokenizer) built on the device.

The batch is an RL rollout's: --prompts prompts of --prompt-len random tokens, --samples completions each at
temperature 1, exactly --new-tokens new tokens each (ignore_eos), logprobs returned; decode CUDA graphs on, up to
the batch's --prompts x --samples requests as a run sizes them for one engine (--graphs-sglang-default: SGLang's
own largest graph, set by the GPU's memory).

relax's engine and bare SGLang are both started, side by side, each with --mem-fraction of the device, and take
turns over --rounds rounds (the first side alternates: relax first in even rounds), so that neither gains from
the machine's state; the ratio is of their tokens/s summed over the rounds, with each round's ratio beside it.
HF generate runs after them, alone, a smaller batch (--hf-prompts prompts x --samples, the same new tokens): its
padded batch would take minutes at the full size; its tokens/s is per the batch it ran.

Prints one JSON line per side and round and the ratios relax / bare SGLang and relax / HF. Needs the GPU
verification bundle (docs/gpu-verification.md):
    source tests/gpu/bundle/enter.sh && python3 benchmarks/rollout_throughput_gpu.py
"""

import argparse
import json
import tempfile
import time

import torch

# New tokens of each side's untimed warm-up on the full batch. With a warm-up of 8 x 2 requests both sides' first
# timed round ran about 1.6x as long as their second (H100, 2026-12-06: 8.58 / 5.33 s and 8.19 / 5.39 s).
WARM_UP_TOKENS = 32

SERVER_FIELDS = dict(
    attention_backend="triton", sampling_backend="pytorch", disable_prefill_cuda_graph=True, log_level="warning",
)


def random_prompts(count: int, length: int, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab_size, (count, length), generator=generator).tolist()


class RelaxSide:
    name = "relax"

    def __init__(self, model_dir: str, server_fields: dict):
        from relax.platform import get_platform
        from relax.rollout.engine import RolloutEngine

        self.engine = RolloutEngine(dict(server_fields), model_path=model_dir, platform=get_platform("cuda"))

    def generate(self, prompts, samples: int, new_tokens: int) -> int:
        """The new tokens of prompts x samples completions of exactly new_tokens tokens each."""
        from relax.rollout.engine import SamplingConfig

        sampling = SamplingConfig(n=samples, temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
        return sum(len(c.token_ids) for group in self.engine.generate(prompts, sampling) for c in group)

    def shutdown(self):
        self.engine.shutdown()


class BareSGLangSide:
    name = "sglang"

    def __init__(self, model_dir: str, server_fields: dict):
        import sglang

        from relax.ports import free_port

        self.engine = sglang.Engine(model_path=model_dir, port=free_port(), **server_fields)

    def generate(self, prompts, samples: int, new_tokens: int) -> int:
        params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
        requests = [list(p) for p in prompts for _ in range(samples)]
        outputs = self.engine.generate(input_ids=requests, sampling_params=params, return_logprob=True)
        return sum(len(o["output_ids"]) for o in outputs)

    def shutdown(self):
        self.engine.shutdown()


def engine_rounds(model_dir: str, prompts, args, server_fields: dict) -> dict[str, list[dict]]:
    """Each engine side's timed generations, round by round, the two engines resident side by side."""
    sides = [RelaxSide(model_dir, server_fields), BareSGLangSide(model_dir, server_fields)]
    results = {side.name: [] for side in sides}
    try:
        for side in sides:  # warm-up at the full batch: its prefill and decode shapes, untimed
            side.generate(prompts, args.samples, WARM_UP_TOKENS)
        for round_index in range(args.rounds):
            for side in sides if round_index % 2 == 0 else sides[::-1]:
                start = time.perf_counter()
                new_tokens = side.generate(prompts, args.samples, args.new_tokens)
                seconds = time.perf_counter() - start
                result = {"side": side.name, "round": round_index, "seconds": seconds, "new_tokens": new_tokens,
                          "tokens_per_s": new_tokens / seconds}
                results[side.name].append(result)
                print(json.dumps(result), flush=True)
    finally:
        for side in sides:
            side.shutdown()
    return results


def hf_side(model_dir: str, prompts, args) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    batch = torch.tensor([p for p in prompts[: args.hf_prompts] for _ in range(args.samples)], device="cuda")
    generate = dict(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens, pad_token_id=0)
    model.generate(batch[:8], **{**generate, "max_new_tokens": 16, "min_new_tokens": 16})  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(batch, **generate)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new_tokens = (out.shape[1] - batch.shape[1]) * out.shape[0]
    del model
    torch.cuda.empty_cache()
    return {"side": "hf_generate", "seconds": seconds, "new_tokens": new_tokens, "tokens_per_s": new_tokens / seconds,
            "sequences": out.shape[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--hf-prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4, help="turns of each engine side")
    parser.add_argument("--mem-fraction", type=float, default=0.42, help="of the device, for each engine side")
    parser.add_argument(
        "--graphs-sglang-default", action="store_true",
        help="leave the largest decode graph at SGLang's default (to measure what relax's sizing changes)",
    )
    args = parser.parse_args()

    from relax.rollout.engine_fields import rollout_decode_graph_fields
    from relax.tools.tiny_model import QWEN3_1_7B_BODY, build_tiny_model

    # the decode graphs a run's engine gets for this batch (relax.args applies the same rule to --sglang-* flags)
    requests = args.prompts * args.samples
    graphs = {} if args.graphs_sglang_default else rollout_decode_graph_fields(SERVER_FIELDS, requests)
    server_fields = {**SERVER_FIELDS, "mem_fraction_static": args.mem_fraction, **graphs}

    with tempfile.TemporaryDirectory() as directory:
        model_dir = str(build_tiny_model(directory, "qwen3", device="cuda", dtype=torch.bfloat16, **QWEN3_1_7B_BODY))
        torch.cuda.empty_cache()
        vocab_size = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
        prompts = random_prompts(args.prompts, args.prompt_len, vocab_size)
        rounds = engine_rounds(model_dir, prompts, args, server_fields)
        hf = hf_side(model_dir, prompts, args)
        print(json.dumps(hf), flush=True)

    def tokens_per_s(side: str) -> float:
        return sum(r["new_tokens"] for r in rounds[side]) / sum(r["seconds"] for r in rounds[side])

    print(json.dumps({
        "relax_over_sglang": tokens_per_s("relax") / tokens_per_s("sglang"),
        "relax_over_sglang_per_round": [
            r["tokens_per_s"] / s["tokens_per_s"] for r, s in zip(rounds["relax"], rounds["sglang"])
        ],
        "relax_over_hf_generate": tokens_per_s("relax") / hf["tokens_per_s"],
        "batch": f"{args.prompts} prompts x {args.samples} samples, {args.prompt_len} prompt tokens, "
                 f"{args.new_tokens} new tokens",
        "decode_graph_max_bs": server_fields.get("cuda_graph_max_bs_decode", "SGLang's default"),
        "mem_fraction_per_engine": args.mem_fraction,
    }))


if __name__ == "__main__":
    main()
