"""The SGLang-compatible /generate endpoint an engine actor serves for custom generate functions
(relax.rollout.generate_server): a request's fields as the engine takes them, bad requests refused naming the field,
the answers over HTTP, and the engine actor's answer (relax.rollout.worker), aborted while an abort drains."""

import asyncio
from collections import Counter
from types import SimpleNamespace

import aiohttp
import pytest

from relax.ports import free_port
from relax.rollout.generate_server import (
    HOST,
    BadRequest,
    EngineUnavailable,
    GenerateRequest,
    GenerateServer,
    aborted_output,
    parse_request,
)
from relax.rollout.worker import EngineWorker, answer_http_request

PARAMS = {"max_new_tokens": 4, "temperature": 1.0, "stop": ["</tool>"], "no_stop_trim": True}


def test_a_request_of_token_ids_or_text_is_taken_as_sglang_has_it():
    assert parse_request({"input_ids": [1, 2], "sampling_params": PARAMS, "return_logprob": True}) == (
        GenerateRequest([1, 2], PARAMS, True)
    )
    assert parse_request({"text": "2+2=", "sampling_params": PARAMS}) == GenerateRequest("2+2=", PARAMS, False)
    assert parse_request({"input_ids": [7], "return_routed_experts": False, "stream": False}) == (
        GenerateRequest([7], {}, False)
    )


@pytest.mark.parametrize("body, field", [
    ([1, 2], "the body is a JSON list"),
    ({"sampling_params": PARAMS}, "input_ids or text: give exactly one"),
    ({"input_ids": [1], "text": "a"}, "input_ids or text: give exactly one"),
    ({"input_ids": []}, "input_ids: must be a non-empty list"),
    ({"input_ids": [1, "2"]}, "input_ids: must be a non-empty list"),
    ({"input_ids": "12"}, "input_ids: must be a non-empty list"),
    ({"text": ""}, "text: must be a non-empty string"),
    ({"input_ids": [1], "sampling_params": [4]}, "sampling_params: a JSON list"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob: 'yes' is not true or false"),
    ({"input_ids": [1], "stream": True}, "stream: only false is served"),
    ({"input_ids": [1], "return_routed_experts": True}, "return_routed_experts: only false is served"),
    ({"input_ids": [1], "image_data": ["x.png"]}, "image_data: not a field relax's /generate takes"),
])
def test_a_bad_request_is_refused_naming_the_field(body, field):
    with pytest.raises(BadRequest, match="^" + field.replace("(", r"\(")):
        parse_request(body)


def test_an_aborted_answer_is_sglangs_with_no_tokens():
    assert aborted_output(3, return_logprob=True) == {
        "text": "", "output_ids": [],
        "meta_info": {"finish_reason": {"type": "abort", "message": "aborted: the step's batch is full"},
                      "prompt_tokens": 3, "completion_tokens": 0, "cached_tokens": 0, "output_token_logprobs": []},
    }
    assert "output_token_logprobs" not in aborted_output(3, return_logprob=False)["meta_info"]


# --- over HTTP ---------------------------------------------------------------------------------------------------

def sglang_output(input_ids: list[int], output_ids: list[int], finish: str = "stop") -> dict:
    """What SGLang answers a request of `input_ids` that sampled `output_ids` (each logprob -0.5)."""
    return {"text": "".join(chr(96 + i) for i in output_ids), "output_ids": output_ids,
            "meta_info": {"finish_reason": {"type": finish}, "prompt_tokens": len(input_ids),
                          "completion_tokens": len(output_ids), "cached_tokens": 0,
                          "output_token_logprobs": [(-0.5, i, None) for i in output_ids]}}


async def answer(request: GenerateRequest) -> dict:
    if request.prompt == [0]:
        raise EngineUnavailable("the engine for /model was shut down")
    if request.sampling_params.get("temperature", 0) < 0:
        raise ValueError("temperature must be non-negative, got -1")
    return sglang_output(request.prompt, [1, 2])


async def post_all(bodies: list) -> list[tuple[int, dict]]:
    server = GenerateServer(answer, free_port(HOST))
    await server.start()
    answers = []
    try:
        async with aiohttp.ClientSession() as session:
            for body in bodies:
                kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
                async with session.post(f"http://{HOST}:{server.port}/generate", **kwargs) as response:
                    answers.append((response.status, await response.json()))
    finally:
        await server.stop()
    return answers


def test_the_endpoint_answers_sglangs_output_and_refuses_bad_requests_with_400_and_a_gone_engine_with_503():
    ok, bad_json, missing, refused, gone = asyncio.run(post_all([
        {"input_ids": [5, 6], "sampling_params": PARAMS, "return_logprob": True},
        b"{not json",
        {"sampling_params": PARAMS},
        {"input_ids": [5], "sampling_params": {"temperature": -1}},
        {"input_ids": [0]},
    ]))
    assert ok == (200, {**sglang_output([5, 6], [1, 2]), "meta_info": {
        **sglang_output([5, 6], [1, 2])["meta_info"], "output_token_logprobs": [[-0.5, 1, None], [-0.5, 2, None]]}})
    assert bad_json[0] == 400 and bad_json[1]["error"]["message"].startswith("the body is not JSON")
    assert missing == (400, {"error": {"message": "input_ids or text: give exactly one of them (the prompt's token "
                                                  "ids or its text)"}})
    assert refused == (400, {"error": {"message": "the engine refused the request: ValueError: temperature must be "
                                                  "non-negative, got -1"}})
    assert gone == (503, {"error": {"message": "the engine for /model was shut down"}})


# --- the engine actor's answer -------------------------------------------------------------------------------------

class FakeSGLangEngine:
    """SGLang's Engine as the actor's answer calls it: records each async_generate call's arguments."""

    def __init__(self):
        self.calls = []
        self.tokenizer_manager = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda text: [ord(c) for c in text]))

    async def async_generate(self, **kwargs):
        self.calls.append(kwargs)
        return sglang_output(kwargs.get("input_ids", [0]), [3])


def actor(aborts: int, groups: Counter) -> EngineWorker:
    worker = EngineWorker.__new__(EngineWorker)  # only what answer_http_request reads
    worker._engine, worker.aborts, worker.custom_groups = FakeSGLangEngine(), aborts, groups
    return worker


def test_the_actor_sends_a_request_as_relaxs_own_and_answers_aborted_until_the_aborted_groups_are_back():
    worker = actor(aborts=0, groups=Counter({0: 2}))
    assert asyncio.run(answer_http_request(worker, GenerateRequest([5, 6], PARAMS, True))) == sglang_output([5, 6], [3])
    asyncio.run(answer_http_request(worker, GenerateRequest("ab", PARAMS, False)))
    assert worker._engine.calls == [
        {"input_ids": [5, 6], "sampling_params": PARAMS, "return_logprob": True, "return_routed_experts": False,
         "priority": None},
        {"prompt": "ab", "sampling_params": PARAMS, "return_logprob": False, "return_routed_experts": False,
         "priority": None},
    ]
    worker.aborts = 1  # abort_requests: the two groups that ran at it still run
    worker.custom_groups[1] += 1  # a group started after it does not lift the abort
    assert asyncio.run(answer_http_request(worker, GenerateRequest("ab", PARAMS, True))) == aborted_output(2, True)
    worker.custom_groups[0] = 0  # back
    assert asyncio.run(answer_http_request(worker, GenerateRequest([5], PARAMS, True)))["meta_info"][
        "finish_reason"] == {"type": "stop"}
    assert len(worker._engine.calls) == 3
    worker._engine, worker._end_reason = None, "the engine for /model was shut down"
    with pytest.raises(EngineUnavailable, match="shut down"):
        asyncio.run(answer_http_request(worker, GenerateRequest([5], PARAMS, True)))
