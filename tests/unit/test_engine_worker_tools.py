"""EngineWorker's multi-turn groups (--tools) over a scripted engine in place of SGLang: each sample's turns run as
one coroutine, seeded by its index in the group, and come back as completions with their loss mask and tool counts;
a sample begun in an earlier step (partial rollout) goes on where it stopped (the real engine in the loop:
tests/e2e/test_loop_tools.py)."""

import asyncio
import inspect
import json
from types import SimpleNamespace

import pytest

from helpers import user_prompt_ids
from relax.rollout.engine import CONTINUED_RESPONSE_PRIORITY, Completion, SamplingConfig
from relax.rollout.multi_turn import ToolRollout
from relax.rollout.partial import GroupSoFar, ResponseSoFar
from relax.rollout.tool_calls import ToolUse
from relax.rollout.tools import load_tools
from relax.rollout.turns import ChatTurns
from relax.rollout.worker import EngineWorker

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>'


class ScriptedWorker(EngineWorker):
    """An engine actor with tools whose engine answers the k-th request seeded s with script[s][k]; `abort_after`:
    the request after which an abort comes (while the sample's tool runs)."""

    def __init__(self, tokenizer, script: dict[int, list[str]], abort_after: int | None = None):
        self.server_args = SimpleNamespace(enable_priority_scheduling=True)  # as --partial-rollout turns it on
        self.tool_rollout = ToolRollout(("calculator",), 3, {})
        self.aborts = 0
        self.chat_turns = ChatTurns(tokenizer)
        self.tools = load_tools(list(self.tool_rollout.tools), "--tools")
        self.tokenizer, self.script, self.abort_after = tokenizer, script, abort_after
        self.requests: list[tuple[list[int], dict]] = []
        self.priorities: list[int | None] = []

    def _live(self):
        return "the engine"

    def _run(self, coroutine):
        return asyncio.run(coroutine)

    async def generate_request(self, engine, request, params, priority):
        assert engine == "the engine"
        self.requests.append((list(request), params))
        self.priorities.append(priority)
        seed = params["sampling_seed"]
        turn = sum(p["sampling_seed"] == seed for _, p in self.requests) - 1
        if len(self.requests) == self.abort_after:
            self.aborts += 1
        ids = self.tokenizer.encode(self.script[seed][turn], add_special_tokens=False)
        return Completion(ids, [-1.0] * len(ids), "stop", "")


@pytest.fixture(scope="module")
def tokenizer(tool_chat_tokenizer):
    return tool_chat_tokenizer


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return user_prompt_ids(tokenizer, "2+3?")


def test_each_sample_runs_its_turns_with_its_own_seed_and_comes_back_with_its_mask_and_counts(tokenizer, prompt):
    worker = ScriptedWorker(tokenizer, {10: [CALL, "5<|im_end|>"], 11: ["no<|im_end|>"]})
    called, answered = worker.generate_group(prompt, SamplingConfig(n=2, seed=10, max_new_tokens=200))

    call, answer = (tokenizer.encode(text, add_special_tokens=False) for text in (CALL, "5<|im_end|>"))
    appended = worker.chat_turns.after_assistant(call, ["5"])
    assert called.token_ids == call + appended + answer
    assert called.loss_mask == [1] * len(call) + [0] * len(appended) + [1] * len(answer)
    assert called.logprobs == [-1.0] * len(call) + [0.0] * len(appended) + [-1.0] * len(answer)
    assert called.tool_use == ToolUse(turns=2, tool_calls=1) and called.finish_reason == "stop"
    assert called.text == tokenizer.decode(called.token_ids, skip_special_tokens=True)  # what the reward reads
    assert answered.loss_mask == [1] * len(answered.token_ids) and answered.tool_use == ToolUse(turns=1)
    # sample j is seeded 10 + j in every turn; its second turn is sent the whole conversation so far
    assert sorted(params["sampling_seed"] for _, params in worker.requests) == [10, 10, 11]
    assert worker.priorities == [None] * 3  # new samples: no request goes before the others
    assert [request for request, params in worker.requests if params["sampling_seed"] == 10][1] == \
        prompt + call + appended


def test_an_abort_while_a_tool_runs_ends_the_sample_before_its_next_turn(tokenizer, prompt):
    worker = ScriptedWorker(tokenizer, {0: [CALL, "5<|im_end|>"]}, abort_after=1)
    (completion,) = worker.generate_group(prompt, SamplingConfig(n=1, seed=0, max_new_tokens=200))
    assert len(worker.requests) == 1  # the second turn never reached the engine
    assert completion.finish_reason == "abort" and completion.tool_use == ToolUse(turns=2, tool_calls=1)


def test_a_multi_turn_group_continues_its_responses_begun_earlier_where_they_stopped(tokenizer, prompt):
    """Partial rollout: a sample aborted while its tool ran (its next turn never began) goes back with its group,
    through a checkpoint, and a later step's group continues it: the completion holds what it generated since, the
    counts all its turns."""
    sampling = SamplingConfig(n=1, seed=0, max_new_tokens=200)
    (aborted,) = ScriptedWorker(tokenizer, {0: [CALL]}, abort_after=1).generate_group(prompt, sampling)
    group = GroupSoFar([ResponseSoFar().extended(aborted, step=0).to_continue_later()])
    (so_far,) = GroupSoFar.from_state_dict(json.loads(json.dumps(group.state_dict()))).responses
    worker = ScriptedWorker(tokenizer, {0: ["5<|im_end|>"]})
    (completion,) = worker.generate_group(prompt, sampling, prefixes=[so_far])
    response = so_far.extended(completion, step=1)

    call, answer = (tokenizer.encode(text, add_special_tokens=False) for text in (CALL, "5<|im_end|>"))
    appended = worker.chat_turns.after_assistant(call, ["5"])
    ((request, params),) = worker.requests  # the tool is not called again: only the answer's turn
    assert request == prompt + call + appended and params["max_new_tokens"] == 200 - len(call) - len(appended)
    assert worker.priorities == [CONTINUED_RESPONSE_PRIORITY]  # before new requests, as a single-turn continuation
    assert completion.token_ids == answer and completion.loss_mask == [1] * len(answer)
    assert completion.text == tokenizer.decode(answer, skip_special_tokens=True)
    assert response.token_ids == call + appended + answer
    assert response.loss_mask == [1] * len(call) + [0] * len(appended) + [1] * len(answer)
    assert response.logprobs == [-1.0] * len(call) + [0.0] * len(appended) + [-1.0] * len(answer)
    assert response.steps == [0] * (len(call) + len(appended)) + [1] * len(answer)
    assert response.tool_use == ToolUse(turns=2, tool_calls=1) and response.finish_reason == "stop"


def test_the_engine_actor_has_no_async_method():
    """Ray makes a class with an async method an async actor, whose __init__ runs off the main thread on Ray's loop,
    where SGLang's Engine takes a loop other than the engine's own (relax.rollout.worker)."""
    methods = [member for _, member in inspect.getmembers(EngineWorker, inspect.isfunction)]
    assert not [m.__name__ for m in methods if inspect.iscoroutinefunction(m) or inspect.isasyncgenfunction(m)]
