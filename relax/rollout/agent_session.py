"""Agent sessions: OpenAI's Chat Completions API in front of the engine, for a custom generate function
(--custom-generate-function-path) that runs an agent written against that API (the `openai` client, or any HTTP client
posting to .../v1/chat/completions), and the agent's conversation trained token in, token out: the sample's ids are the
ids the engine sampled and the ids relax appended between its turns, never a re-tokenization of the assistant's text.

    from openai import AsyncOpenAI
    from relax.rollout.agent_session import finish_session, open_session

    async def generate(args, sample, sampling_params):
        base_url = open_session(sample, sampling_params)
        await my_agent(AsyncOpenAI(base_url=base_url, api_key="unused"), sample)  # posts chat completions
        return finish_session(base_url, sample)

How, and why so:
- A session is one sample. open_session returns the base URL http://127.0.0.1:PORT/sessions/<id>/v1 of the engine
  actor's own endpoint (relax.rollout.generate_server, beside its /generate): an unmodified OpenAI client posts to
  {base_url}/chat/completions, so the path says which sample a call belongs to, and every call of the sample reaches
  the engine that holds its conversation in its prefix cache. The calls go to the engine as the function's own
  requests do (relax.rollout.custom_generate.generate): answered aborted after an abort.
- The first call's messages, rendered (the chat template with the call's tools and its generation prompt), are the
  sample's prompt ids: an agent brings its own system prompt and tool descriptions, as real agents do, and the sample
  trains on that prompt and its response (a custom generate function's sample may start from other ids than its
  data row's: relax.rollout.custom_generate). The data row still gives the function its question, and the reward
  function its prompt text, label and metadata. A prompt the engine's context cannot hold with the session's budget
  makes the engine refuse the call, which fails the sample.
- Each later call must extend the session's conversation: its messages are the previous call's messages, then the
  assistant message relax returned, unchanged, then new tool or user messages. relax appends only the template's
  rendering of the new messages after the ids it sampled (relax.rollout.turns.ChatTurns: not trained, loss mask 0,
  logprob 0.0) and generates from there (trained: loss mask 1, the engine's logprobs). A call that edits the history,
  sends another assistant text or adds an assistant message is refused with HTTP 400 saying which message; there are
  no branches: a sample is one sequence, and another conversation is another session.
- The budget: sampling_params' max_new_tokens (the rollout's response length) bounds the session's whole response,
  appended ids included; a call's max_tokens bounds that call. When the appended ids leave no room, the call answers
  finish_reason "length" with no content and the session ends TRUNCATED, as relax's own multi-turn rollout does.
- Tool calls are read in Qwen's format (relax.rollout.tool_calls) from what the engine sampled after any thinking
  block and returned in OpenAI's `tool_calls` shape (the content: the text before the first call), finish_reason
  "tool_calls"; a malformed block is not a call and stays in the content. Otherwise "stop" or "length".
- One call of a session at a time; a call after the session ended (budget spent, an abort, a request the engine
  refused) is refused. An aborted call is answered HTTP 400 so the agent stops; finish_session then gives the sample
  ABORTED (its prompt goes back for a later step), with no response: the agent's conversation lives in the agent, so
  even with --partial-rollout a later step calls the function anew from the prompt. Sessions a function opened but did
  not finish end with its group.

A request takes model (any: the engine serves one model), messages, tools, tool_choice ("auto" only), max_tokens or
max_completion_tokens, temperature and top_p (the call's, instead of the run's: the logprobs are at that temperature),
stop, n (1 only) and stream (false only); any other field is refused with HTTP 400 naming it. The sample's other
sampling parameters (seed, top_k, stop ids) are the function's sampling_params.
"""

import contextlib
import contextvars
import functools
import itertools
import json
import time
from dataclasses import dataclass, field

from relax.rollout.custom_generate import EngineRequest, Sample, append_generated, append_masked, current_engine
from relax.rollout.generate_server import BadRequest, UnknownPath
from relax.rollout.tool_calls import parse_tool_calls, text_before_tool_calls
from relax.rollout.turns import ChatTurns

CHAT_FIELDS = ("model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "temperature",
               "top_p", "stop", "n", "stream")
# The roles a later call may add after relax's assistant message: relax trains on assistant text it sampled only
NEW_MESSAGE_ROLES = ("tool", "user")


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    max_tokens: int | None  # this call's bound, besides the session's budget
    sampling: dict  # SGLang's sampling parameters the call sets (temperature, top_p, stop)


def parse_chat_request(body) -> ChatRequest:
    """A chat completion request's JSON body; BadRequest naming the field that relax cannot serve."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body is a JSON {type(body).__name__}, not an object of OpenAI's chat completion fields")
    unknown = sorted(set(body) - set(CHAT_FIELDS))
    if unknown:
        raise BadRequest(f"{unknown[0]}: not a field relax's chat completions take (they take "
                         f"{', '.join(CHAT_FIELDS)})")
    if body.get("n", 1) != 1:
        raise BadRequest(f"n: {body['n']!r}; only 1 is served (a session is one sample: open one per sample)")
    if body.get("stream", False) is not False:
        raise BadRequest("stream: only false is served (relax answers each call whole)")
    if body.get("tool_choice", "auto") != "auto":
        raise BadRequest(f"tool_choice: {body['tool_choice']!r}; only \"auto\" is served (the model decides)")
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages
            and all(isinstance(message, dict) and isinstance(message.get("role"), str) for message in messages)):
        raise BadRequest("messages: must be a non-empty list of chat messages (objects with a role)")
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise BadRequest("tools: must be a list of tool objects ({\"type\": \"function\", \"function\": {...}})")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise BadRequest("max_tokens and max_completion_tokens: give one of them")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and not (_is_number(max_tokens) and max_tokens == int(max_tokens) >= 1):
        raise BadRequest(f"max_tokens: {max_tokens!r} is not a positive integer")
    sampling = {}
    if body.get("temperature") is not None:
        if not (_is_number(body["temperature"]) and body["temperature"] >= 0):
            raise BadRequest(f"temperature: {body['temperature']!r} is not a number >= 0")
        sampling["temperature"] = body["temperature"]
    if body.get("top_p") is not None:
        if not (_is_number(body["top_p"]) and 0 < body["top_p"] <= 1):
            raise BadRequest(f"top_p: {body['top_p']!r} is not a number in (0, 1]")
        sampling["top_p"] = body["top_p"]
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stop, list) and all(isinstance(text, str) and text for text in stop)):
            raise BadRequest(f"stop: {body['stop']!r} is not a string or a list of non-empty strings")
        sampling["stop"] = stop
    return ChatRequest(messages, tools, max_tokens, sampling)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def new_messages(conversation: list[dict], messages: list[dict]) -> list[dict]:
    """The messages a later call adds to the session's `conversation` (its earlier messages and relax's assistant
    messages); BadRequest saying which message does not extend it."""
    if len(messages) <= len(conversation):
        raise BadRequest(
            f"messages: {len(messages)} messages do not extend the session's conversation of {len(conversation)} "
            "(the earlier messages and relax's last assistant message); send them all, then the new tool or user "
            "messages"
        )
    for index, (recorded, sent) in enumerate(zip(conversation, messages)):
        if _canonical(recorded) != _canonical(sent):
            raise BadRequest(
                f"messages[{index}]: this {sent.get('role')} message differs from the session's conversation "
                f"({_canonical(sent)!r:.200} instead of {_canonical(recorded)!r:.200}); a session is one sequence of "
                "ids: send the earlier messages and relax's assistant messages unchanged (open another session for "
                "another conversation)"
            )
    added = messages[len(conversation):]
    for index, message in enumerate(added, start=len(conversation)):
        if message["role"] not in NEW_MESSAGE_ROLES:
            raise BadRequest(
                f"messages[{index}]: a {message['role']} message after relax's assistant message; a later call adds "
                f"only {' and '.join(NEW_MESSAGE_ROLES)} messages (the sample trains on what the engine sampled)"
            )
    return added


def _canonical(message: dict) -> dict:
    """A message as the session compares it: fields without a value (None, "", []) are absent, as clients that
    echo an assistant message back write them one way or the other."""
    return {key: value for key, value in message.items() if value not in (None, "", [])}


@dataclass
class ChatSession:
    id: str
    engine: EngineRequest  # the function's requests, answered aborted after an abort
    sampling_params: dict  # the function's; max_new_tokens is the budget of the session's whole response
    sample: Sample  # the first call's rendering (its prompt), then the response so far
    conversation: list[dict] | None = None  # the messages a next call starts with; None before the first call
    tools: list[dict] | None = None  # the first call's: the prompt's ids hold their descriptions
    last_sampled: list[int] = field(default_factory=list)  # the last call's sampled ids, which the next ids follow
    calls: int = 0  # engine requests made
    ended: str | None = None  # why no later call continues it
    in_call: bool = False


class ChatSessions:
    """The agent sessions of one engine actor, served at `base_url`'s /sessions/<id>/v1/chat/completions
    (relax.rollout.generate_server) on the engine's event loop."""

    def __init__(self, model_path: str, chat_template_kwargs: dict, base_url: str):
        self.model_path, self.chat_template_kwargs, self.base_url = model_path, dict(chat_template_kwargs), base_url
        self.sessions: dict[str, ChatSession] = {}
        self._ids = itertools.count()

    @functools.cached_property
    def turns(self) -> ChatTurns:
        """The chat template's turns; the tokenizer is loaded by the first session (most runs open none)."""
        from transformers import AutoTokenizer

        return ChatTurns(AutoTokenizer.from_pretrained(self.model_path), self.chat_template_kwargs)

    @contextlib.contextmanager
    def serving(self):
        """Around a group's calls of the function (relax.rollout.worker): open_session opens its sessions here, and
        those it left open end with the group."""
        opened: set[str] = set()
        token = _SERVING.set((self, opened))
        try:
            yield
        finally:
            _SERVING.reset(token)
            for session_id in opened:
                self.sessions.pop(session_id, None)

    def open(self, sample: Sample, sampling_params: dict, engine: EngineRequest) -> str:
        """A new session of `sample` (its prompt, no response yet); its id."""
        if sample.response_length:
            raise ValueError(f"the sample already holds {sample.response_length} response tokens: a session starts "
                             "from the prompt alone")
        if sampling_params.get("ignore_eos"):
            raise ValueError("ignore_eos: an agent session needs each turn to end where the model ends it")
        session_id = f"s{next(self._ids)}"
        self.sessions[session_id] = ChatSession(session_id, engine, dict(sampling_params), Sample(sample.prompt))
        return session_id

    def url(self, session_id: str) -> str:
        return f"{self.base_url}/sessions/{session_id}/v1"

    def finish(self, session_id: str, sample: Sample) -> Sample:
        """`sample` with the session's ids, loss mask, logprobs, response and status (an ABORTED one as it was, its
        response not kept); the session ends."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise ValueError(f"no open agent session {session_id} (finished already, or opened for another group)")
        if not session.calls:
            raise ValueError(f"agent session {session_id}: the agent made no chat completion call in it")
        sample.status = session.sample.status
        if sample.status is Sample.Status.ABORTED:  # no response: an agent's conversation is not resumed
            return sample
        for name in ("tokens", "response", "response_length", "loss_mask", "rollout_log_probs"):
            setattr(sample, name, getattr(session.sample, name))
        return sample

    async def complete(self, session_id: str, body) -> dict:
        """OpenAI's chat completion object answering the call `body` of the session; BadRequest for a call that the
        session cannot take, UnknownPath for a session that is not open."""
        session = self.sessions.get(session_id)
        if session is None:
            raise UnknownPath(f"no open agent session {session_id}: open_session opens one, for one sample, until "
                              "finish_session or the end of its group")
        request = parse_chat_request(body)
        if session.ended is not None:
            raise BadRequest(f"the session has ended: {session.ended}")
        if session.in_call:
            raise BadRequest("a call of this session is still being answered: a session's calls follow each other")
        session.in_call = True
        try:
            return await self._complete(session, request, body.get("model") or "relax")
        finally:
            session.in_call = False

    async def _complete(self, session: ChatSession, request: ChatRequest, model: str) -> dict:
        if session.conversation is None:  # the first call: its conversation rendered is the sample's prompt
            session.sample.tokens = self.turns.prompt_ids(request.messages, request.tools)
            appended, session.tools = [], request.tools
        else:
            added = new_messages(session.conversation, request.messages)
            if (request.tools or None) != session.tools:
                raise BadRequest("tools: not the session's first call's tools, whose descriptions the prompt's ids "
                                 "hold; send the same tools in every call of a session")
            appended = self.turns.after_assistant_messages(session.last_sampled, added)
        sample, budget = session.sample, session.sampling_params["max_new_tokens"]
        left = budget - sample.response_length - len(appended)
        spent = f"its response's token budget of {budget} (sampling_params' max_new_tokens) is spent"
        if left < 1:  # no token left for the model to read the new messages with
            session.ended = spent
            sample.status = Sample.Status.TRUNCATED
            return _chat_completion(session, model, {"role": "assistant", "content": ""}, "length", 0)
        completion = await session.engine(sample.tokens + appended, self._params(session, request, left))
        session.calls += 1  # the sample changes once the engine answered: a call given up before is not half-recorded
        append_masked(sample, appended, self.turns.tokenizer.decode(appended, skip_special_tokens=True))
        append_generated(sample, completion)
        if completion.finish_reason == "abort":
            session.ended = "the engine aborted its request (the step's batch is full): the sample is ABORTED"
            raise BadRequest(f"aborted: {session.ended}; end the agent and call finish_session")
        if completion.finish_reason not in ("stop", "length"):
            session.ended = f"the engine refused its request: {completion.error}"
            raise BadRequest(session.ended)
        if sample.response_length >= budget:
            session.ended = spent
        message = self._assistant_message(session, completion.token_ids)
        session.conversation, session.last_sampled = request.messages + [message], list(completion.token_ids)
        finish_reason = "tool_calls" if "tool_calls" in message and completion.finish_reason == "stop" else (
            completion.finish_reason)
        return _chat_completion(session, model, message, finish_reason, len(completion.token_ids))

    def _params(self, session: ChatSession, request: ChatRequest, left: int) -> dict:
        """SGLang's sampling parameters of a call: the function's, the call's own, at most `left` new tokens, and
        ending at the template's end of turn even where the tokenizer's EOS is another token."""
        params = {**session.sampling_params, **request.sampling}
        params["max_new_tokens"] = min(left, request.max_tokens or left)
        end_of_turn = self.turns.end_of_turn_ids[0]
        stop_token_ids = list(params.get("stop_token_ids") or [])
        params["stop_token_ids"] = stop_token_ids + ([] if end_of_turn in stop_token_ids else [end_of_turn])
        return params

    def _assistant_message(self, session: ChatSession, sampled_ids: list[int]) -> dict:
        """What the engine sampled as OpenAI's assistant message: its text without the end of turn, the tool calls in
        it as `tool_calls`, and the text before them as the content."""
        text_ids = sampled_ids[:len(sampled_ids) - self.turns.sampled_end_of_turn(sampled_ids)]
        text = self.turns.tokenizer.decode(text_ids, skip_special_tokens=False)
        calls = [call for call in parse_tool_calls(text) if call.error is None]
        if not calls:
            return {"role": "assistant", "content": text}
        content = text_before_tool_calls(text)
        tool_calls = [
            {"id": f"call_{session.id}_{session.calls}_{i}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for i, call in enumerate(calls)
        ]
        return {"role": "assistant", "content": content, "tool_calls": tool_calls}


def _chat_completion(session: ChatSession, model: str, message: dict, finish_reason: str, completion_tokens: int
                     ) -> dict:
    prompt_tokens = len(session.sample.tokens) - completion_tokens
    return {
        "id": f"chatcmpl-{session.id}-{session.calls}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


# --- what a custom generate function calls ------------------------------------------------------------------

_SERVING: contextvars.ContextVar[tuple[ChatSessions, set[str]]] = contextvars.ContextVar("relax_agent_sessions")


def open_session(sample: Sample, sampling_params: dict) -> str:
    """A session for `sample` (as the function got it: its prompt, no response) sampled with the function's
    `sampling_params`; the base URL an OpenAI client takes (base_url=...)."""
    try:
        sessions, opened = _SERVING.get()
    except LookupError:
        raise RuntimeError("relax.rollout.agent_session.open_session opens a session only in a function that relax "
                           "calls for --custom-generate-function-path (in the engine's actor)") from None
    session_id = sessions.open(sample, sampling_params, current_engine("relax.rollout.agent_session.open_session"))
    opened.add(session_id)
    return sessions.url(session_id)


def finish_session(base_url: str, sample: Sample) -> Sample:
    """The session at `base_url` (open_session's) as the function's sample: `sample` with the first call's prompt
    ids and the response's, loss mask (1 sampled, 0 appended), rollout_log_probs, response_length, response text and
    status (COMPLETED, TRUNCATED), or ABORTED when the engine aborted a call, the sample then as the function got it
    (the agent's conversation cannot be resumed: with partial rollout a later step calls the function anew); the
    session ends."""
    try:
        sessions, _ = _SERVING.get()
    except LookupError:
        raise RuntimeError("relax.rollout.agent_session.finish_session: no agent sessions are served here (call it in "
                           "the function that opened the session)") from None
    return sessions.finish(base_url.rstrip("/").removesuffix("/v1").rsplit("/", 1)[-1], sample)
