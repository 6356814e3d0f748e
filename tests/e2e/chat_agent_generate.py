"""An agent written against OpenAI's Chat Completions API (the openai client), run as a custom generate function
through an agent session (relax.rollout.agent_session), for tests/e2e/test_loop_custom_generate.py: it asks the
copy_digit question as its data row holds it after a system prompt of its own (SYSTEM_PROMPT: its first call's
rendering becomes the sample's prompt), answers the model's first turn (at most FIRST_TURN_TOKENS) with a tool result,
and takes the second turn. The random tiny model writes no tool calls: the agent sends its tool message after
whatever the model wrote, as a harness that always runs a tool would.

Each session it completes is appended to the JSON-lines file RELAX_TEST_AGENT_SAMPLES names: what the API answered
(each call's content, finish reason and token counts) and the prompt and response ids finish_session gave, for the test
to check them."""

import json
import os

from openai import AsyncOpenAI, BadRequestError

from relax.rollout.agent_session import finish_session, open_session
from relax.rollout.custom_generate import Sample
from slime_style_generate import half_over_http
from two_turn_generate import FIRST_TURN_TOKENS, SURPLUS_GROUP, TOOL_TEXT, tokenizer_of, two_turns

AGENT_SAMPLE = 2  # sample j of a group that the agent generates (the odd ones post to /generate)
FINISHED = (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)  # the statuses that are trained
SYSTEM_PROMPT = "You copy digits."  # the agent's own: the data rows have none
TOOLS = [{"type": "function", "function": {"name": "copy", "description": "copies a digit",
                                           "parameters": {"type": "object", "properties": {"digit": {}}}}}]


def first_messages(label) -> list[dict]:
    """The agent's first call's conversation: its own system prompt, then the row's question."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"copy {label}:"}]


async def chat_agent(args, sample: Sample, sampling_params: dict) -> Sample:
    base_url = open_session(sample, sampling_params)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = first_messages(sample.label)
    answers = []
    try:
        for max_tokens in (FIRST_TURN_TOKENS, None):
            answer = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                                          max_tokens=max_tokens)
            answers.append(answer)
            messages += [answer.choices[0].message, {"role": "tool", "tool_call_id": "call_0", "content": TOOL_TEXT}]
    except BadRequestError as error:
        if "aborted" not in str(error):  # the step's batch is full: the session's sample is ABORTED
            raise
    sample = finish_session(base_url, sample)
    prompt_length = len(sample.tokens) - sample.response_length  # the agent's first call rendered
    if sample.status is not Sample.Status.ABORTED:
        with open(os.environ["RELAX_TEST_AGENT_SAMPLES"], "a") as records:
            records.write(json.dumps({
                "prompt_ids": sample.tokens[:prompt_length], "sampling_seed": sampling_params["sampling_seed"],
                "response_token_ids": sample.tokens[prompt_length:],
                "calls": [{"content": a.choices[0].message.content, "finish_reason": a.choices[0].finish_reason,
                           "prompt_tokens": a.usage.prompt_tokens, "completion_tokens": a.usage.completion_tokens}
                          for a in answers],
            }) + "\n")
    return sample


def first_turn_of(sample: Sample, hf_checkpoint: str) -> Sample:
    """A sample of `sample`'s prompt and first turn alone (its response up to its first masked token): a fan-out
    sibling, as a function that trains each turn of a conversation as a sample of its own returns one."""
    prompt_length = len(sample.tokens) - sample.response_length
    turn = sample.loss_mask.index(0)
    ids = sample.tokens[prompt_length:prompt_length + turn]
    return Sample(
        sample.prompt, sample.label, dict(sample.metadata), tokens=sample.tokens[:prompt_length] + ids,
        response=tokenizer_of(hf_checkpoint).decode(ids, skip_special_tokens=True), response_length=turn,
        loss_mask=[1] * turn, rollout_log_probs=sample.rollout_log_probs[:turn],
        status=Sample.Status.TRUNCATED if turn == FIRST_TURN_TOKENS else Sample.Status.COMPLETED,
    )


async def with_an_agent(args, sample: Sample, sampling_params: dict,
                        evaluation: bool = False) -> Sample | list[Sample]:
    """The run's function: slime_style_generate.half_over_http, but sample AGENT_SAMPLE of the step's groups after
    its first two (sample j of group k is seeded step seed + k x n + j) is chat_agent's, and their last sample fans
    out: the sample and its first turn alone (first_turn_of), which join its group. The step's surplus group and the
    samples an earlier step's left ABORTED are two_turn_generate.two_turns'."""
    group, j = divmod(sampling_params["sampling_seed"] % 2**24, args.n_samples_per_prompt)
    if not evaluation and (group == SURPLUS_GROUP or sample.status is Sample.Status.ABORTED):
        return await two_turns(args, sample, sampling_params)
    if not evaluation and group >= 2 and j == AGENT_SAMPLE:
        return await chat_agent(args, sample, sampling_params)
    sample = await half_over_http(args, sample, sampling_params, evaluation)
    if not evaluation and group >= 2 and j == args.n_samples_per_prompt - 1 and sample.status in FINISHED:
        return [sample, first_turn_of(sample, args.hf_checkpoint)]
    return sample
