"""A custom generate function for tests/e2e/test_loop_custom_generate.py, as a user writes one for
--custom-generate-function-path: two turns around a fixed "tool" text, which is not trained; one turn in an
evaluation.

A group's requests are seeded from the step's first seed (a multiple of 2**24: relax.run.state.sampling_seed) plus
k x n + j for sample j of the step's k-th group (relax.rollout.rollout.collect_groups), so each sample knows its
place: every step, the samples of its first group raise (the group fails) and those of its second come back ABORTED,
both at once, before any other group completes (a group still generating when the batch is full is put back
uncounted)."""

import functools

from transformers import AutoTokenizer

from relax.rollout.custom_generate import Sample, append_generated, append_masked, generate

TOOL_TEXT = " = "  # characters of the tiny tokenizer's alphabet: one token each
FIRST_TURN_TOKENS = 2


@functools.cache
def tokenizer_of(path: str):
    return AutoTokenizer.from_pretrained(path)


def tool_ids(hf_checkpoint: str) -> list[int]:
    return tokenizer_of(hf_checkpoint).encode(TOOL_TEXT, add_special_tokens=False)


async def two_turns(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    if evaluation:
        append_generated(sample, await generate(sample.tokens, sampling_params))
        return sample
    group = sampling_params["sampling_seed"] % 2**24 // args.n_samples_per_prompt
    if group == 0:
        raise RuntimeError("the test function fails the step's first group")
    if group == 1:
        sample.status = Sample.Status.ABORTED
        return sample
    budget = sampling_params["max_new_tokens"]
    append_generated(sample, await generate(sample.tokens, {**sampling_params, "max_new_tokens": FIRST_TURN_TOKENS}))
    if sample.status is Sample.Status.ABORTED:  # the step's batch is full
        return sample
    append_masked(sample, tool_ids(args.hf_checkpoint), TOOL_TEXT)
    left = budget - sample.response_length
    append_generated(sample, await generate(sample.tokens, {**sampling_params, "max_new_tokens": left}))
    return sample
