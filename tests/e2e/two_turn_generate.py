"""A custom generate function for tests/e2e/test_loop_custom_generate.py, as a user writes one for
--custom-generate-function-path: two turns around a fixed "tool" text, which is not trained; one turn in an
evaluation.

A group's requests are seeded from the step's first seed (a multiple of 2**24: relax.run.state.sampling_seed) plus
k x n + j for sample j of the step's k-th group (relax.rollout.rollout.collect_groups), so each sample knows its
place. The run over-samples (--over-sampling-batch-size 5 for 2 groups) with --partial-rollout, so every step submits
its first 5 groups at once: the samples of its first group raise (the group fails), those of its second come back
ABORTED after their first turn, both before any other group completes (a group still generating when the batch is full
is put back uncounted); the third and fourth are trained; the fifth (SURPLUS_GROUP) takes its first turn and stays in
flight until the step's abort ends it (surplus_until_the_abort). The second and fifth groups go back with their
samples' first turns (partial rollout), and the next step takes them first, as its first and second groups: a call
given such a sample (status ABORTED, its response so far) records it and fails as the first group's do, or returns it
ABORTED again as the second group's do, so the step's counts stay those of a step without partial rollout.

Each sample it returns ABORTED itself and each one it is given to continue is appended to the JSON-lines file
RELAX_TEST_PARTIAL_SAMPLES names (kind "returned" or "continued"), its fields as the function saw them, for the test
to check that a later step's call gets exactly what an earlier one returned."""

import asyncio
import functools
import json
import os

from transformers import AutoTokenizer

from relax.rollout.custom_generate import Sample, append_generated, append_masked, generate

TOOL_TEXT = " = "  # characters of the tiny tokenizer's alphabet: one token each
FIRST_TURN_TOKENS = 2
SURPLUS_GROUP = 4  # the step's group that is still generating when its batch is full
POLL_SECONDS = 0.2  # how often a surplus sample asks the engine whether the step's abort came


@functools.cache
def tokenizer_of(path: str):
    return AutoTokenizer.from_pretrained(path)


def tool_ids(hf_checkpoint: str) -> list[int]:
    return tokenizer_of(hf_checkpoint).encode(TOOL_TEXT, add_special_tokens=False)


def group_of(args, sampling_params: dict) -> int:
    """The index of the sample's group among the step's groups."""
    return sampling_params["sampling_seed"] % 2**24 // args.n_samples_per_prompt


async def two_turns(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    if evaluation:
        append_generated(sample, await generate(sample.tokens, sampling_params))
        return sample
    group = group_of(args, sampling_params)
    if sample.status is Sample.Status.ABORTED:  # an earlier step's, with its first turn (partial rollout)
        record("continued", sample, sampling_params)
        if group == 0:
            raise RuntimeError("the test function fails the step's first group")
        return sample
    if group == 0:
        raise RuntimeError("the test function fails the step's first group")
    budget = sampling_params["max_new_tokens"]
    append_generated(sample, await generate(sample.tokens, {**sampling_params, "max_new_tokens": FIRST_TURN_TOKENS}))
    if group == 1:
        sample.status = Sample.Status.ABORTED
    if group == SURPLUS_GROUP and sample.status is not Sample.Status.ABORTED:
        await surplus_until_the_abort(sample, sampling_params)
    if sample.status is Sample.Status.ABORTED:  # the step's batch is full (or group 1's)
        if sample.response_length:  # kept for a later step (partial rollout)
            sample.metadata["returned_by_seed"] = sampling_params["sampling_seed"]
            record("returned", sample, sampling_params)
        return sample
    append_masked(sample, tool_ids(args.hf_checkpoint), TOOL_TEXT)
    left = budget - sample.response_length
    append_generated(sample, await generate(sample.tokens, {**sampling_params, "max_new_tokens": left}))
    return sample


async def surplus_until_the_abort(sample: Sample, sampling_params: dict) -> None:
    """Keep the sample in flight until the step's abort: one-token requests, each answer dropped, until one comes
    back aborted (every request a group sends after the abort does), which ends the sample's response ABORTED."""
    while True:
        await asyncio.sleep(POLL_SECONDS)
        answer = await generate(sample.tokens, {**sampling_params, "max_new_tokens": 1})
        if answer.finish_reason == "abort":
            append_generated(sample, answer)
            return


def record(kind: str, sample: Sample, sampling_params: dict) -> None:
    with open(os.environ["RELAX_TEST_PARTIAL_SAMPLES"], "a") as records:
        records.write(json.dumps({
            "kind": kind, "sampling_seed": sampling_params["sampling_seed"],
            "max_new_tokens": sampling_params["max_new_tokens"], "status": sample.status.name,
            "tokens": sample.tokens, "response": sample.response, "response_length": sample.response_length,
            "loss_mask": sample.loss_mask, "rollout_log_probs": sample.rollout_log_probs, "metadata": sample.metadata,
        }) + "\n")
