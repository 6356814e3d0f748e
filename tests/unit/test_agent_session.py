"""Agent sessions (relax.rollout.agent_session) over a scripted engine and the tool-chat tokenizer (Qwen3's chat
format): a call's fields, the check that each call extends the session's conversation, the ids a session records
(the prompt, each turn's sampled ids, the template's ids of the new messages between them), its budget and aborts,
and an agent written with the openai client through the engine actor's HTTP server."""

import asyncio

import aiohttp
import pytest

from relax.ports import free_port
from relax.rollout.agent_session import ChatSessions, finish_session, new_messages, open_session, parse_chat_request
from relax.rollout.custom_generate import CustomGenerateFn, Sample, completion_of, generate_samples
from relax.rollout.data import Prompt
from relax.rollout.engine import Completion
from relax.rollout.generate_server import HOST, BadRequest, GenerateServer, UnknownPath
from relax.rollout.turns import ChatTurns
from relax.tools.tiny_model import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluates an expression",
                                           "parameters": {"type": "object", "properties": {"expression": {}}}}}]
QUESTION = [{"role": "user", "content": "what is 1+2?"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call><|im_end|>'
ANSWER = "it is 3<|im_end|>"
PARAMS = {"max_new_tokens": 200, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": None, "sampling_seed": 7}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A directory holding the tool-chat tokenizer: what ChatSessions loads from the model's path."""
    path = tmp_path_factory.mktemp("tool_chat_model")
    build_tokenizer(path, tool_chat=True)
    return str(path)


@pytest.fixture(scope="module")
def turns(model_path):
    return ChatSessions(model_path, {}, "http://x").turns


def encode(turns: ChatTurns, text: str) -> list[int]:
    return turns.tokenizer.encode(text, add_special_tokens=False)


class ScriptedEngine:
    """The function's requests: each answers the next of `texts` (its ids, each logprob -0.5) with `finish`; records
    the input ids and sampling parameters of each."""

    def __init__(self, turns: ChatTurns, texts: list[str], finish: str = "stop"):
        self.answers = [encode(turns, text) for text in texts]
        self.finish, self.requests = finish, []

    async def __call__(self, input_ids: list[int], params: dict) -> Completion:
        self.requests.append((input_ids, params))
        if self.finish == "abort":
            return Completion.aborted()
        ids = self.answers.pop(0)[:params["max_new_tokens"]]
        return Completion(ids, [-0.5] * len(ids), self.finish, "")


def prompt_sample(turns: ChatTurns) -> Sample:
    """A sample whose prompt is QUESTION with TOOLS rendered, as the rollout gives it to the function."""
    return Sample("the prompt", tokens=turns.prompt_ids(QUESTION, TOOLS))


def opened(model_path: str, engine, budget: int = 200) -> tuple[ChatSessions, str, Sample]:
    sessions = ChatSessions(model_path, {}, "http://x")
    sample = prompt_sample(sessions.turns)
    return sessions, sessions.open(sample, {**PARAMS, "max_new_tokens": budget}, engine), sample


def call(sessions: ChatSessions, session_id: str, messages: list[dict], **fields) -> dict:
    return asyncio.run(sessions.complete(session_id, {"model": "m", "messages": messages, "tools": TOOLS, **fields}))


# --- a call's fields --------------------------------------------------------------------------------------------

def test_a_call_takes_openais_sampling_fields_as_sglangs():
    request = parse_chat_request({"model": "any", "messages": QUESTION, "tools": TOOLS, "tool_choice": "auto",
                                  "max_completion_tokens": 5, "temperature": 0.5, "top_p": 0.9, "stop": "\n", "n": 1,
                                  "stream": False})
    assert (request.messages, request.tools, request.max_tokens) == (QUESTION, TOOLS, 5)
    assert request.sampling == {"temperature": 0.5, "top_p": 0.9, "stop": ["\n"]}
    assert parse_chat_request({"messages": QUESTION, "max_tokens": 3, "tools": []}).max_tokens == 3


@pytest.mark.parametrize("fields, message", [
    ({"n": 2}, "n: 2; only 1 is served"),
    ({"stream": True}, "stream: only false is served"),
    ({"logprobs": True}, "logprobs: not a field relax's chat completions take"),
    ({"tool_choice": "required"}, "tool_choice: 'required'; only \"auto\""),
    ({"messages": []}, "messages: must be a non-empty list"),
    ({"messages": [{"content": "hi"}]}, "messages: must be a non-empty list"),
    ({"tools": {"calculator": {}}}, "tools: must be a list"),
    ({"max_tokens": 0}, "max_tokens: 0 is not a positive integer"),
    ({"max_tokens": 2, "max_completion_tokens": 2}, "max_tokens and max_completion_tokens: give one"),
    ({"temperature": -1}, "temperature: -1 is not a number >= 0"),
    ({"top_p": 0}, "top_p: 0 is not a number in"),
    ({"stop": [""]}, "stop: [''] is not a string or a list"),
])
def test_a_call_relax_cannot_serve_is_refused_naming_the_field(fields, message):
    with pytest.raises(BadRequest, match="^" + message.replace("(", r"\(").replace("[", r"\[")):
        parse_chat_request({"messages": QUESTION, **fields})


# --- the conversation a later call extends ------------------------------------------------------------------------

ASSISTANT = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_s0_1_0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'}}
]}
RESULT = {"role": "tool", "content": "3", "tool_call_id": "call_s0_1_0"}


def test_a_later_call_adds_tool_and_user_messages_to_the_conversation_sent_back_unchanged():
    conversation = QUESTION + [ASSISTANT]
    echoed = {**ASSISTANT, "content": None, "refusal": None, "audio": None}  # as a client writes it back
    assert new_messages(conversation, QUESTION + [echoed, RESULT]) == [RESULT]
    user = {"role": "user", "content": "and 2+2?"}
    assert new_messages(conversation, conversation + [RESULT, user]) == [RESULT, user]


@pytest.mark.parametrize("messages, message", [
    (QUESTION + [ASSISTANT], "messages: 2 messages do not extend the session's conversation of 2"),
    ([{"role": "user", "content": "what is 2+2?"}, ASSISTANT, RESULT], r"messages\[0\]: this user message differs"),
    (QUESTION + [{"role": "assistant", "content": "3"}, RESULT], r"messages\[1\]: this assistant message differs"),
    (QUESTION + [{**ASSISTANT, "tool_calls": [{**ASSISTANT["tool_calls"][0], "function": {
        "name": "calculator", "arguments": '{"expression":"1+2"}'}}]}, RESULT], r"messages\[1\]: this assistant"),
    (QUESTION + [ASSISTANT, {"role": "assistant", "content": "3"}], r"messages\[2\]: a assistant message after"),
    (QUESTION + [ASSISTANT, RESULT, {"role": "system", "content": "be brief"}], r"messages\[3\]: a system message"),
])
def test_a_call_that_does_not_extend_the_conversation_is_refused_saying_which_message(messages, message):
    with pytest.raises(BadRequest, match="^" + message):
        new_messages(QUESTION + [ASSISTANT], messages)


# --- the ids a session records -----------------------------------------------------------------------------------

def test_two_turns_with_a_tool_are_the_sampled_ids_and_the_templates_tool_turn_between_them(model_path, turns):
    engine = ScriptedEngine(turns, [CALL, ANSWER])
    sessions, session_id, sample = opened(model_path, engine)
    prompt = list(sample.tokens)
    first = call(sessions, session_id, QUESTION)
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    message = first["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_s0_1_0", "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'}}]}
    assert first["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(encode(turns, CALL)),
                              "total_tokens": len(prompt) + len(encode(turns, CALL))}

    second = call(sessions, session_id, QUESTION + [message, RESULT], temperature=0.5, max_tokens=50)
    assert second["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "it is 3"},
                                    "finish_reason": "stop", "logprobs": None}
    sampled = [encode(turns, CALL), encode(turns, ANSWER)]
    # The tool turn as the template writes it after the sampled turn (which ended on <|im_end|>: not appended twice)
    tool_turn = encode(turns, "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
                              "<|im_start|>assistant\n")
    assert turns.after_assistant_messages(sampled[0], [RESULT]) == tool_turn
    (first_ids, first_params), (second_ids, second_params) = engine.requests
    assert first_ids == prompt and second_ids == prompt + sampled[0] + tool_turn
    end_of_turn = turns.end_of_turn_ids[0]
    assert first_params == {**PARAMS, "stop_token_ids": [end_of_turn]}
    left = 200 - len(sampled[0]) - len(tool_turn)
    assert second_params == {**PARAMS, "stop_token_ids": [end_of_turn], "temperature": 0.5, "max_new_tokens": 50}
    assert left > 50

    assert sessions.finish(session_id, sample) is sample and sample.status is Sample.Status.COMPLETED
    assert sample.tokens == prompt + sampled[0] + tool_turn + sampled[1]
    assert sample.response_length == len(sample.tokens) - len(prompt)
    assert sample.loss_mask == [1] * len(sampled[0]) + [0] * len(tool_turn) + [1] * len(sampled[1])
    assert sample.rollout_log_probs == [-0.5] * len(sampled[0]) + [0.0] * len(tool_turn) + [-0.5] * len(sampled[1])
    assert session_id not in sessions.sessions


def test_the_first_calls_own_system_prompt_and_tools_rendered_are_the_samples_prompt_which_it_trains_on(
        model_path, turns):
    engine = ScriptedEngine(turns, [ANSWER])
    sessions, session_id, sample = opened(model_path, engine)
    row_prompt = list(sample.tokens)
    own = [{"role": "system", "content": "you are an agent"}, *QUESTION]
    own_tools = TOOLS + [{"type": "function", "function": {"name": "search", "description": "finds a page",
                                                           "parameters": {"type": "object", "properties": {}}}}]
    answer = call(sessions, session_id, own, tools=own_tools)
    rendered, sampled = turns.prompt_ids(own, own_tools), encode(turns, ANSWER)
    assert rendered[:len(row_prompt)] != row_prompt and answer["usage"]["prompt_tokens"] == len(rendered)
    assert engine.requests[0][0] == rendered
    sessions.finish(session_id, sample)
    assert sample.tokens == rendered + sampled and sample.response_length == len(sampled)
    assert sample.loss_mask == [1] * len(sampled) and sample.rollout_log_probs == [-0.5] * len(sampled)
    completion = completion_of(sample, row_prompt, budget=200)  # as the rollout takes it: the agent's prompt ids
    assert completion.prompt_ids == rendered and completion.token_ids == sampled and completion.error is None
    with pytest.raises(UnknownPath, match="no open agent session s9"):
        call(sessions, "s9", QUESTION)


def test_the_budget_bounds_the_whole_session_and_a_session_that_spent_it_ends_truncated(model_path, turns):
    budget = len(encode(turns, CALL)) + 5  # the tool turn does not fit after the first turn
    sessions, session_id, sample = opened(model_path, ScriptedEngine(turns, [CALL, ANSWER]), budget)
    message = call(sessions, session_id, QUESTION)["choices"][0]["message"]
    assert call(sessions, session_id, QUESTION + [message, RESULT])["choices"][0] == {
        "index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "length", "logprobs": None}
    with pytest.raises(BadRequest, match="^the session has ended: its response's token budget of"):
        call(sessions, session_id, QUESTION + [message, RESULT, {"role": "assistant", "content": ""}, RESULT])
    sessions.finish(session_id, sample)
    assert sample.status is Sample.Status.TRUNCATED and sample.loss_mask == [1] * len(encode(turns, CALL))


def test_a_call_the_engine_aborts_is_refused_and_the_session_gives_an_aborted_sample(model_path, turns):
    sessions, session_id, sample = opened(model_path, ScriptedEngine(turns, [], finish="abort"))
    row_prompt = list(sample.tokens)
    with pytest.raises(BadRequest, match="^aborted: the engine aborted its request"):
        call(sessions, session_id, QUESTION)
    assert sessions.finish(session_id, sample).status is Sample.Status.ABORTED
    # an abort after a turn: the sample as the function got it, no response kept (partial rollout calls the function
    # anew: an agent's conversation is not resumed)
    engine = ScriptedEngine(turns, [ANSWER])
    sessions, session_id, sample = opened(model_path, engine)
    message = call(sessions, session_id, QUESTION)["choices"][0]["message"]
    engine.finish = "abort"
    with pytest.raises(BadRequest, match="^aborted: the engine aborted its request"):
        call(sessions, session_id, QUESTION + [message, RESULT])
    assert sessions.finish(session_id, sample).status is Sample.Status.ABORTED
    assert (sample.tokens, sample.response_length, sample.response, sample.loss_mask) == (row_prompt, 0, "", None)


def test_a_session_without_a_call_cannot_be_finished_and_one_is_finished_once(model_path, turns):
    sessions, session_id, sample = opened(model_path, ScriptedEngine(turns, []))
    with pytest.raises(ValueError, match="the agent made no chat completion call in it"):
        sessions.finish(session_id, sample)
    with pytest.raises(ValueError, match="no open agent session s0"):
        sessions.finish(session_id, sample)


# --- an agent of the openai client, through the engine actor's server ------------------------------------------

async def openai_agent(base_url: str) -> list[str]:
    """An agent as one is written against OpenAI's API: it asks, runs the calculator on the model's call, answers."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages, finishes = list(QUESTION), []
    while True:
        response = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        choice = response.choices[0]
        finishes.append(choice.finish_reason)
        if choice.finish_reason != "tool_calls":
            return finishes
        messages.append(choice.message)
        messages += [{"role": "tool", "tool_call_id": tool_call.id, "content": "3"}
                     for tool_call in choice.message.tool_calls]


def test_an_openai_client_agent_runs_its_session_through_the_server_and_the_function_gets_its_ids(model_path, turns):
    engine = ScriptedEngine(turns, [CALL, ANSWER])
    sessions = ChatSessions(model_path, {}, f"http://{HOST}:{free_port(HOST)}")
    prompt = Prompt(1, prompt_sample(turns).tokens, "the prompt", None)
    finishes = []

    async def agent_function(args, sample, sampling_params):
        base_url = open_session(sample, sampling_params)
        assert base_url == f"{sessions.base_url}/sessions/s0/v1"
        finishes.extend(await openai_agent(base_url))
        return finish_session(base_url, sample)

    async def run() -> list[Completion]:
        server = GenerateServer(None, int(sessions.base_url.rsplit(":", 1)[1]), sessions.complete)
        await server.start()
        try:
            with sessions.serving():
                return await generate_samples(CustomGenerateFn(agent_function, "agent", False), None, prompt, PARAMS,
                                             engine)
        finally:
            await server.stop()

    (completion,) = asyncio.run(run())
    assert completion.error is None and finishes == ["tool_calls", "stop"]
    sampled_call = encode(turns, CALL)
    tool_turn = turns.after_assistant_messages(sampled_call, [RESULT])
    assert completion.token_ids == sampled_call + tool_turn + encode(turns, ANSWER)
    assert completion.loss_mask == [1] * len(sampled_call) + [0] * len(tool_turn) + [1] * len(encode(turns, ANSWER))
    assert engine.requests[1][0] == prompt.token_ids + sampled_call + tool_turn
    assert sessions.sessions == {}


def test_over_http_a_call_relax_cannot_serve_gets_400_and_a_session_that_is_not_open_404(model_path, turns):
    sessions, session_id, _ = opened(model_path, ScriptedEngine(turns, []))
    port = free_port(HOST)

    async def post_all(paths_and_bodies) -> list[tuple[int, dict]]:
        server = GenerateServer(None, port, sessions.complete)
        await server.start()
        try:
            async with aiohttp.ClientSession() as client:
                answers = []
                for path, body in paths_and_bodies:
                    async with client.post(f"http://{HOST}:{port}{path}", json=body) as response:
                        answers.append((response.status, await response.json()))
                return answers
        finally:
            await server.stop()

    streamed, unknown = asyncio.run(post_all([
        (f"/sessions/{session_id}/v1/chat/completions", {"messages": QUESTION, "stream": True}),
        ("/sessions/s7/v1/chat/completions", {"messages": QUESTION}),
    ]))
    assert streamed == (400, {"error": {"message": "stream: only false is served (relax answers each call whole)"}})
    assert unknown[0] == 404 and unknown[1]["error"]["message"].startswith("no open agent session s7")


def test_open_session_serves_only_a_function_relax_calls():
    with pytest.raises(RuntimeError, match="opens a session only in a function that relax calls"):
        open_session(Sample("p", tokens=[1]), PARAMS)
