"""A custom generate function as one is written for slime, for tests/e2e/test_loop_custom_generate.py
(two_turns_over_http): it posts its
requests with aiohttp to http://{args.sglang_router_ip}:{args.sglang_router_port}/generate, SGLang's fields in and
out, and builds the sample from the answers itself (slime's examples do: search-r1 sends its prompt as text, retool
as input_ids). The same two turns as two_turn_generate.two_turns: a first turn of FIRST_TURN_TOKENS, a fixed "tool"
text (not trained), a second turn. Only its import of Sample is relax's.

Each sample it completes is appended to the JSON-lines file RELAX_TEST_HTTP_SAMPLES names, as the engine returned it,
for the test to compare with the trained samples."""

import json
import os

import aiohttp

from relax.rollout.custom_generate import Sample
from two_turn_generate import FIRST_TURN_TOKENS, TOOL_TEXT, tool_ids, two_turns


async def post(args, payload: dict) -> dict:
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as response:
        response.raise_for_status()
        return await response.json()


def append_turn(sample: Sample, output: dict) -> None:
    """The engine's answer as the sample's next trained tokens; the status follows its finish reason."""
    token_logprobs = output["meta_info"]["output_token_logprobs"]  # [logprob, token_id, text] per output token
    sample.tokens += [token_id for _, token_id, *_ in token_logprobs]
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [logprob for logprob, *_ in token_logprobs]
    sample.loss_mask = (sample.loss_mask or []) + [1] * len(token_logprobs)
    sample.response_length += len(token_logprobs)
    sample.response += output["text"]
    sample.status = {"stop": Sample.Status.COMPLETED, "length": Sample.Status.TRUNCATED,
                     "abort": Sample.Status.ABORTED}[output["meta_info"]["finish_reason"]["type"]]


async def two_turns_over_http(args, sample: Sample, sampling_params: dict) -> Sample:
    prompt_length, budget = len(sample.tokens), sampling_params["max_new_tokens"]
    first = await post(args, {"text": sample.prompt, "return_logprob": True,
                              "sampling_params": {**sampling_params, "max_new_tokens": FIRST_TURN_TOKENS}})
    append_turn(sample, first)
    if sample.status is Sample.Status.ABORTED:  # the step's batch is full
        return sample
    tool = tool_ids(args.hf_checkpoint)
    sample.tokens += tool
    sample.loss_mask += [0] * len(tool)
    sample.rollout_log_probs += [0.0] * len(tool)
    sample.response_length += len(tool)
    sample.response += TOOL_TEXT
    second = await post(args, {"input_ids": sample.tokens, "return_logprob": True,
                               "sampling_params": {**sampling_params, "max_new_tokens": budget - sample.response_length}})
    append_turn(sample, second)
    if sample.status is not Sample.Status.ABORTED:
        with open(os.environ["RELAX_TEST_HTTP_SAMPLES"], "a") as records:
            records.write(json.dumps({
                "prompt_ids": sample.tokens[:prompt_length], "sampling_seed": sampling_params["sampling_seed"],
                "response_token_ids": sample.tokens[prompt_length:], "response_logprobs": sample.rollout_log_probs,
                "loss_mask": sample.loss_mask,
            }) + "\n")
    return sample


async def half_over_http(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """The run's function: two_turn_generate.two_turns, but the odd samples of the step's groups after its first two
    (sample j of group k is seeded step seed + k x n + j) are two_turns_over_http's."""
    group, j = divmod(sampling_params["sampling_seed"] % 2**24, args.n_samples_per_prompt)
    if not evaluation and group >= 2 and j % 2:
        return await two_turns_over_http(args, sample, sampling_params)
    return await two_turns(args, sample, sampling_params, evaluation)
