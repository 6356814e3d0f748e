"""HF transformers' greedy continuation, the reference SGLang engines are checked against."""

import torch
import transformers


def hf_greedy(model_dir, prompts: list[list[int]], new_tokens: int, model_class=transformers.AutoModelForCausalLM):
    """(token ids, logprob of each chosen token) per prompt, float32, one whole forward per token.

    Not `generate`: SGLang's ignore_eos still lets greedy pick the EOS token, while generate's min_new_tokens
    masks it out, so the two would part as soon as EOS is the top token."""
    model = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids, logprobs = list(prompt), []
        with torch.no_grad():
            for _ in range(new_tokens):
                step = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                ids.append(int(step.argmax()))
                logprobs.append(step[ids[-1]].item())
        outputs.append((ids[len(prompt):], logprobs))
    return outputs
