"""SGLang's `/generate` over HTTP in front of one in-process engine, for custom generate functions written for slime
(--custom-generate-function-path), which post their requests to http://{args.sglang_router_ip}:{args.sglang_router_port}
/generate.

Why relax serves it itself rather than SGLang's HTTP servers behind the sglang-router package: relax's engines run
in-process with no HTTP server, and a router spreads requests over engines by load, so a sample's next turn could go
to an engine without its conversation in the prefix cache. Each engine actor that runs a custom generate function
serves its own endpoint on 127.0.0.1 (relax.rollout.worker), and the `args` a function gets there name that endpoint:
every request of a sample reaches the engine that owns its group, by construction. The endpoint passes requests to
the engine as relax's own generate does (relax.rollout.engine.sglang_generate), on the engine's event loop.

A request (a JSON object, SGLang's fields):
    input_ids              the prompt's token ids, or
    text                   the prompt's text, which the engine tokenizes (one of the two)
    sampling_params        SGLang's sampling parameters (max_new_tokens, temperature, top_p, top_k, stop,
                           stop_token_ids, sampling_seed, no_stop_trim, skip_special_tokens, ...); SGLang checks them
    return_logprob         whether meta_info carries output_token_logprobs (default false)
    return_routed_experts  false only: relax refuses --use-rollout-routing-replay with a custom generate function
    stream                 false only
The answer is SGLang's own output as its HTTP server returns it: `text`, `output_ids` and `meta_info` with
`finish_reason` ({"type": "stop" | "length" | "abort", ...}), `prompt_tokens`, `completion_tokens`, `cached_tokens`,
`weight_version` and, with return_logprob, `output_token_logprobs` ([logprob, token_id, text] per output token). A
request that the engine refuses, or that is malformed, gets HTTP 400 with {"error": {"message": ...}} naming the
field; one sent while the engine is shut down gets 503.

The same server answers OpenAI's chat completions of the agent sessions a function opens
(/sessions/<id>/v1/chat/completions: relax.rollout.agent_session), 404 for a session that is not open.
"""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

HOST = "127.0.0.1"  # the functions run in the engine's own process
# The largest request body: a prompt of a million token ids is about 8 MB of JSON (aiohttp's default is 1 MiB)
MAX_REQUEST_BYTES = 64 << 20
# How long a shutdown waits for requests in flight before it cancels them: an engine shut down answers none
SHUTDOWN_WAIT_S = 1.0
FIELDS = ("input_ids", "text", "sampling_params", "return_logprob", "return_routed_experts", "stream")


class BadRequest(ValueError):
    """A request this endpoint cannot serve: HTTP 400, the message naming the field."""


class UnknownPath(LookupError):
    """A request for something the server does not hold (an agent session not open): HTTP 404."""


@dataclass(frozen=True)
class GenerateRequest:
    prompt: list[int] | str  # input_ids, or text the engine tokenizes
    sampling_params: dict
    return_logprob: bool


def parse_request(body) -> GenerateRequest:
    """A /generate request's JSON body as the engine takes it; BadRequest naming the field that is wrong."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body is a JSON {type(body).__name__}, not an object of SGLang's /generate fields")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise BadRequest(f"{unknown[0]}: not a field relax's /generate takes (it takes {', '.join(FIELDS)})")
    for name in ("return_routed_experts", "stream"):
        if body.get(name):
            raise BadRequest(f"{name}: only false is served (relax answers each request whole; routed experts are "
                             "not returned with --custom-generate-function-path)")
    if ("input_ids" in body) == ("text" in body):
        raise BadRequest("input_ids or text: give exactly one of them (the prompt's token ids or its text)")
    prompt = body.get("input_ids", body.get("text"))
    if "input_ids" in body and not (
        isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
    ):
        raise BadRequest("input_ids: must be a non-empty list of token ids (integers)")
    if "text" in body and not (isinstance(prompt, str) and prompt):
        raise BadRequest("text: must be a non-empty string")
    sampling_params = body.get("sampling_params") or {}
    if not isinstance(sampling_params, dict):
        raise BadRequest(f"sampling_params: a JSON {type(sampling_params).__name__}, not an object of SGLang's "
                         "sampling parameters")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise BadRequest(f"return_logprob: {return_logprob!r} is not true or false")
    return GenerateRequest(prompt, dict(sampling_params), return_logprob)


def aborted_output(prompt_tokens: int, return_logprob: bool) -> dict:
    """SGLang's answer to a request aborted before it reached the engine: no tokens, finish_reason abort."""
    meta_info = {"finish_reason": {"type": "abort", "message": "aborted: the step's batch is full"},
                 "prompt_tokens": prompt_tokens, "completion_tokens": 0, "cached_tokens": 0}
    return {"text": "", "output_ids": [], "meta_info": meta_info | ({"output_token_logprobs": []} if return_logprob
                                                                      else {})}


class EngineUnavailable(RuntimeError):
    """The engine behind the endpoint is shut down: HTTP 503."""


class GenerateServer:
    """The /generate endpoint on HOST and `port`, each request answered by `answer` (an awaitable of SGLang's output
    dict) on the event loop the server runs on. `answer` raises EngineUnavailable when the engine is gone; any other
    exception is the engine refusing the request (HTTP 400). With `chat` (relax.rollout.agent_session's
    ChatSessions.complete: a session id and a JSON body -> an awaitable of OpenAI's chat completion), also the agent
    sessions' /sessions/<id>/v1/chat/completions."""

    def __init__(self, answer: Callable[[GenerateRequest], Awaitable[dict]], port: int,
                 chat: Callable[[str, object], Awaitable[dict]] | None = None):
        self.answer, self.port, self.chat = answer, port, chat
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_post("/generate", self._generate)
        if self.chat is not None:
            app.router.add_post("/sessions/{session}/v1/chat/completions", self._chat_completion)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_WAIT_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _generate(self, request: web.Request) -> web.Response:
        try:
            parsed = parse_request(await _json_body(request))
        except BadRequest as error:
            return _error(400, str(error))
        try:
            output = await self.answer(parsed)
        except EngineUnavailable as error:
            return _error(503, str(error))
        except Exception as error:  # SGLang raises for a request it refuses (sampling params, an over-long prompt)
            return _error(400, f"the engine refused the request: {type(error).__name__}: {error}")
        return _json(200, output)


    async def _chat_completion(self, request: web.Request) -> web.Response:
        try:
            return _json(200, await self.chat(request.match_info["session"], await _json_body(request)))
        except BadRequest as error:
            return _error(400, str(error))
        except UnknownPath as error:
            return _error(404, str(error))


async def _json_body(request: web.Request):
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as error:
        raise BadRequest(f"the body is not JSON: {error}") from None


def _error(status: int, message: str) -> web.Response:
    return _json(status, {"error": {"message": message}})


def _json(status: int, content: dict) -> web.Response:
    # numpy values as SGLang's own server writes them
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
    return web.Response(status=status, body=body, content_type="application/json")
