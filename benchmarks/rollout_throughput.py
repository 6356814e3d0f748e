"""Rollout tokens/s on the CPU: SGLang's in-process engine (through relax.rollout.engine) against HF
transformers' generate, on the same tiny random model and the same prompts, measured in one run.

Both sample (temperature 1) exactly max_new_tokens tokens for every sequence (EOS ignored), so both
produce the same number of tokens; each side gets one untimed warm-up call first.

    .venv/bin/python benchmarks/rollout_throughput.py --num-prompts 32 --n 8 --max-new-tokens 64
"""

import argparse
import os
import tempfile
import time


def sglang_tokens_per_s(model_dir, prompts, args) -> float:
    from relax.platform import get_platform
    from relax.rollout.engine import RolloutEngine, SamplingConfig

    sampling = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    with RolloutEngine({"max_total_tokens": 65536}, model_path=model_dir, platform=get_platform("cpu")) as engine:
        engine.generate(prompts[:2], SamplingConfig(max_new_tokens=4))  # warm-up
        start = time.perf_counter()
        completions = engine.generate(prompts, sampling)
        elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for group in completions for c in group)
    assert tokens == len(prompts) * args.n * args.max_new_tokens, tokens
    return tokens / elapsed


def hf_tokens_per_s(model_dir, prompts, args) -> float:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    width = max(len(p) for p in prompts)
    # left padding, as batched generation needs
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def generate(ids, mask, new_tokens):
        return model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_return_sequences=args.n,
            pad_token_id=tokenizer.pad_token_id,
        )

    with torch.no_grad():
        generate(input_ids[:2], attention_mask[:2], 4)  # warm-up
        start = time.perf_counter()
        output = generate(input_ids, attention_mask, args.max_new_tokens)
        elapsed = time.perf_counter() - start
    tokens = (output.shape[1] - width) * output.shape[0]
    assert tokens == len(prompts) * args.n * args.max_new_tokens, tokens
    return tokens / elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--family", default="qwen3")
    args = parser.parse_args()

    from relax.rollout.data import PromptDataConfig, load_prompts
    from relax.rollout.synthetic import write_task
    from relax.tools.tiny_model import build_tiny_model

    work = tempfile.mkdtemp(prefix="rollout_throughput_")
    model_dir = str(build_tiny_model(os.path.join(work, "model"), args.family))
    data = write_task("reverse3", args.num_prompts, os.path.join(work, "prompts.jsonl"))
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = [p.token_ids for p in load_prompts(PromptDataConfig(str(data)), tokenizer)[0]]

    sglang_rate = sglang_tokens_per_s(model_dir, prompts, args)
    hf_rate = hf_tokens_per_s(model_dir, prompts, args)
    print(
        f"tiny {args.family}, {args.num_prompts} prompts x {args.n} samples x {args.max_new_tokens} new tokens, "
        f"{os.cpu_count()} CPU cores"
    )
    print(f"sglang engine : {sglang_rate:10.1f} tokens/s")
    print(f"hf generate   : {hf_rate:10.1f} tokens/s")
    print(f"ratio sglang/hf: {sglang_rate / hf_rate:.2f}")


if __name__ == "__main__":
    main()
