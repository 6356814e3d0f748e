"""Rollout throughput on one CUDA GPU, in one run (benchmarks/rollout_throughput.py is the CPU one): relax's
engine (relax.rollout.engine.RolloutEngine, what the loop's engine workers call) against bare SGLang (sglang.Engine with the same server arguments and the same
requests) and HF transformers' generate, on a Qwen3-1.7B-shaped model (relax.tools.tiny_model.QWEN3_1_7B_BODY; random
bf16 weights, relax's 64-token tokenizer) built on the device.

The batch is an RL rollout's: --prompts prompts of --prompt-len random tokens, --samples completions each at
temperature 1, exactly --new-tokens new tokens each (ignore_eos), logprobs returned; decode CUDA graphs on, up to
the batch's --prompts x --samples requests as a run sizes them for one engine (--graphs-sglang-default: SGLang's
own largest graph, set by the GPU's memory).
HF generate runs a smaller batch (--hf-prompts prompts x --samples, the same new tokens): its padded batch
would take minutes at the full size; its tokens/s is per the batch it ran.

Prints one JSON line per side and the ratios relax / bare SGLang and relax / HF. Needs the GPU verification
bundle on the lent H200 (docs/gpu-verification.md):
    source tests/gpu/bundle/enter.sh && python3 benchmarks/rollout_throughput_gpu.py
"""

import argparse
import json
import tempfile
from functools import partial
import time

import torch

SERVER_FIELDS = dict(
    attention_backend="triton", sampling_backend="pytorch", disable_prefill_cuda_graph=True,
    mem_fraction_static=0.85, log_level="warning",
)


def random_prompts(count: int, length: int, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab_size, (count, length), generator=generator).tolist()


def relax_side(model_dir: str, prompts, args, server_fields: dict) -> dict:
    from relax.platform import get_platform
    from relax.rollout.engine import RolloutEngine, SamplingConfig

    sampling = SamplingConfig(n=args.samples, temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    with RolloutEngine(dict(server_fields), model_path=model_dir, platform=get_platform("cuda")) as engine:
        engine.generate(prompts[:8], SamplingConfig(n=2, max_new_tokens=16))  # warm-up
        start = time.perf_counter()
        completions = engine.generate(prompts, sampling)
        seconds = time.perf_counter() - start
    new_tokens = sum(len(c.token_ids) for group in completions for c in group)
    return {"side": "relax", "seconds": seconds, "new_tokens": new_tokens, "tokens_per_s": new_tokens / seconds}


def bare_sglang_side(model_dir: str, prompts, args, server_fields: dict) -> dict:
    import sglang

    from relax.ports import free_port

    engine = sglang.Engine(model_path=model_dir, port=free_port(), **server_fields)
    params = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    requests = [list(p) for p in prompts for _ in range(args.samples)]
    try:
        engine.generate(input_ids=requests[:16], sampling_params={**params, "max_new_tokens": 16})  # warm-up
        start = time.perf_counter()
        outputs = engine.generate(input_ids=requests, sampling_params=params, return_logprob=True)
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    new_tokens = sum(len(o["output_ids"]) for o in outputs)
    return {"side": "sglang", "seconds": seconds, "new_tokens": new_tokens, "tokens_per_s": new_tokens / seconds}


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
    parser.add_argument(
        "--graphs-sglang-default", action="store_true",
        help="leave the largest decode graph at SGLang's default (to measure what relax's sizing changes)",
    )
    args = parser.parse_args()

    from relax.rollout.engine import rollout_decode_graph_fields
    from relax.tools.tiny_model import QWEN3_1_7B_BODY, build_tiny_model

    # the decode graphs a run's engine gets for this batch (relax.args applies the same rule to --sglang-* flags)
    requests = args.prompts * args.samples
    graphs = {} if args.graphs_sglang_default else rollout_decode_graph_fields(SERVER_FIELDS, requests)
    server_fields = {**SERVER_FIELDS, **graphs}
    sides = (partial(relax_side, server_fields=server_fields), partial(bare_sglang_side, server_fields=server_fields),
             hf_side)

    with tempfile.TemporaryDirectory() as directory:
        model_dir = str(build_tiny_model(directory, "qwen3", device="cuda", dtype=torch.bfloat16, **QWEN3_1_7B_BODY))
        torch.cuda.empty_cache()
        vocab_size = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
        prompts = random_prompts(args.prompts, args.prompt_len, vocab_size)
        results = {}
        for side in sides:
            result = side(model_dir, prompts, args)
            results[result["side"]] = result
            print(json.dumps(result), flush=True)
    print(json.dumps({
        "relax_over_sglang": results["relax"]["tokens_per_s"] / results["sglang"]["tokens_per_s"],
        "relax_over_hf_generate": results["relax"]["tokens_per_s"] / results["hf_generate"]["tokens_per_s"],
        "batch": f"{args.prompts} prompts x {args.samples} samples, {args.prompt_len} prompt tokens, "
                 f"{args.new_tokens} new tokens",
        "decode_graph_max_bs": server_fields.get("cuda_graph_max_bs_decode", "SGLang's default"),
    }))


if __name__ == "__main__":
    main()
