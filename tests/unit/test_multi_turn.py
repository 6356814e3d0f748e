"""generate_multi_turn over a scripted engine: each request gets the next scripted turn; the script records what it
was sent, so the tests check the token-in/token-out contract turn by turn."""

import asyncio
from dataclasses import dataclass

import pytest

from helpers import user_prompt_ids
from relax.rollout.engine import SamplingConfig
from relax.rollout.multi_turn import MultiTurnResponse, generate_multi_turn, multi_turn_metrics
from relax.rollout.tool_calls import ToolUse
from relax.rollout.tools import Calculator, ToolOutput
from relax.rollout.turns import ChatTurns

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call><|im_end|>'
TOOLS = {"calculator": Calculator()}
REFUSAL = "ValueError: the prompt is longer than the context"


@dataclass
class ScriptedTurn:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"
    error: str | None = None
    routed_experts: str | None = None


class ScriptedEngine:
    def __init__(self, tokenizer, turns: list[tuple[str, str]]):
        """`turns`: (text, finish reason) per request; a turn's logprobs are -1, -2, ... so each is found again."""
        self.turns = [(tokenizer.encode(text, add_special_tokens=False), finish) for text, finish in turns]
        self.requests: list[tuple[list[int], SamplingConfig]] = []

    async def __call__(self, input_ids, sampling):
        self.requests.append((list(input_ids), sampling))
        token_ids, finish = self.turns[len(self.requests) - 1]
        if finish == "error":  # refused: no tokens, the reason
            return ScriptedTurn([], [], finish, REFUSAL)
        token_ids = token_ids[: sampling.max_new_tokens]
        finish = "length" if len(token_ids) == sampling.max_new_tokens and finish == "stop" else finish
        logprobs = [-float(i + 1) for i in range(len(token_ids))]
        return ScriptedTurn(token_ids, logprobs, finish, routed_experts=f"experts of request {len(self.requests)}")


@pytest.fixture(scope="module")
def tokenizer(tool_chat_tokenizer):
    return tool_chat_tokenizer


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return user_prompt_ids(tokenizer, "12345*6789?")


def run(engine, tokenizer, prompt, max_new_tokens=400, max_turns=4, tools=TOOLS, so_far=None) -> MultiTurnResponse:
    sampling = SamplingConfig(n=8, temperature=0.7, max_new_tokens=max_new_tokens, stop_token_ids=(5,))
    return asyncio.run(generate_multi_turn(engine, prompt, sampling, ChatTurns(tokenizer), tools, max_turns, so_far))


def test_each_turn_sends_the_sequence_so_far_and_the_response_is_sampled_plus_appended_ids(tokenizer, prompt):
    engine = ScriptedEngine(tokenizer, [(CALL.format("12345*6789"), "stop"), ("83810205<|im_end|>", "stop")])
    response = run(engine, tokenizer, prompt)
    (first, first_sampling), (second, second_sampling) = engine.requests
    sampled = [engine.turns[0][0], engine.turns[1][0]]
    appended = ChatTurns(tokenizer).after_assistant(sampled[0], ["83810205"])

    assert first == prompt and second == prompt + sampled[0] + appended
    assert response.token_ids == sampled[0] + appended + sampled[1]
    assert second + sampled[1] == prompt + response.token_ids
    assert response.loss_mask == [1] * len(sampled[0]) + [0] * len(appended) + [1] * len(sampled[1])
    turn_logprobs = [[-float(i + 1) for i in range(len(ids))] for ids in sampled]
    assert response.logprobs == turn_logprobs[0] + [0.0] * len(appended) + turn_logprobs[1]
    assert "<tool_response>\n83810205\n</tool_response>" in tokenizer.decode(appended)
    assert (response.finish_reason, response.turns, response.tool_calls, response.tool_failures) == ("stop", 2, 1, 0)
    assert response.routed_experts == "experts of request 2"  # the last request's: the whole sequence's
    # one request per turn, ending at the end-of-turn token; the budget is the whole response's, appended ids included
    assert first_sampling.n == second_sampling.n == 1 and first_sampling.temperature == 0.7
    assert first_sampling.stop_token_ids == (5, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert first_sampling.max_new_tokens == 400
    assert second_sampling.max_new_tokens == 400 - len(sampled[0]) - len(appended)


def test_failed_calls_go_back_to_the_model_and_are_counted(tokenizer, prompt):
    turn = CALL.format("1/0")[:-len("<|im_end|>")] + "\n<tool_call>\n{bad json}\n</tool_call>\n" + CALL.format("2+2")
    engine = ScriptedEngine(tokenizer, [(turn, "stop"), ("4<|im_end|>", "stop")])
    response = run(engine, tokenizer, prompt)
    appended = tokenizer.decode([t for t, m in zip(response.token_ids, response.loss_mask) if m == 0])
    assert appended.count("<tool_response>") == 3
    assert "ZeroDivisionError" in appended and "not JSON" in appended and "\n4\n</tool_response>" in appended
    assert (response.tool_calls, response.tool_failures, response.tool_timeouts) == (3, 2, 0)


class TimingOut:
    name, description, parameters = "python", "always too slow", {}

    def __call__(self, arguments):
        return ToolOutput("[timed out after 10 s]", failed=True, timed_out=True)


def test_a_timeout_is_a_failure_counted_apart(tokenizer, prompt):
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "while 1: pass"}}\n</tool_call><|im_end|>'
    engine = ScriptedEngine(tokenizer, [(call, "stop"), ("no<|im_end|>", "stop")])
    response = run(engine, tokenizer, prompt, tools={"python": TimingOut()})
    assert (response.tool_calls, response.tool_failures, response.tool_timeouts) == (1, 1, 1)
    single = MultiTurnResponse(token_ids=[1, 2], loss_mask=[1, 1], turns=1)
    assert multi_turn_metrics([response, single], [response.loss_mask, single.loss_mask]) == {
        "rollout/turns_mean": 1.5,
        "rollout/tool_calls": 1.0,
        "rollout/tool_failures": 1.0,
        "rollout/tool_timeouts": 1.0,
        "rollout/masked_token_share": response.loss_mask.count(0) / (len(response.token_ids) + 2),
    }


def test_max_turns_ends_a_model_that_keeps_calling(tokenizer, prompt):
    engine = ScriptedEngine(tokenizer, [(CALL.format("1+1"), "stop")] * 3)
    response = run(engine, tokenizer, prompt, max_turns=2)
    assert (response.turns, response.tool_calls, response.finish_reason) == (2, 1, "length")
    assert response.loss_mask[-len(engine.turns[1][0]):] == [1] * len(engine.turns[1][0])  # ends on what it sampled


def test_the_token_budget_ends_the_response(tokenizer, prompt):
    call = tokenizer.encode(CALL.format("1+1"), add_special_tokens=False)
    # room for the call but not for the tool turn after it: the response ends on the call, nothing appended
    engine = ScriptedEngine(tokenizer, [(CALL.format("1+1"), "stop")])
    response = run(engine, tokenizer, prompt, max_new_tokens=len(call) + 5)
    assert response.token_ids == call and response.finish_reason == "length" and response.tool_calls == 1
    # the second turn gets what is left of the budget and is cut there: "length", its tokens kept
    engine = ScriptedEngine(tokenizer, [(CALL.format("1+1"), "stop"), ("2" * 100 + "<|im_end|>", "stop")])
    response = run(engine, tokenizer, prompt, max_new_tokens=len(call) + 60)
    assert engine.requests[1][1].max_new_tokens == 60 - response.loss_mask.count(0)
    assert response.finish_reason == "length" and len(response.token_ids) == len(call) + 60


def test_a_prompt_that_fills_the_context_fails_without_a_request(tokenizer, prompt):
    engine = ScriptedEngine(tokenizer, [])
    sampling = SamplingConfig(max_new_tokens=100, clip_to_context=len(prompt))
    response = asyncio.run(generate_multi_turn(engine, prompt, sampling, ChatTurns(tokenizer), TOOLS, max_turns=2))
    assert engine.requests == [] and (response.finish_reason, response.token_ids, response.turns) == ("error", [], 0)
    assert response.error == (
        f"the prompt's {len(prompt)} tokens leave no room for a response in the {len(prompt)}-token context"
    )


@pytest.mark.parametrize("finish", ["abort", "error"])
def test_an_aborted_or_refused_turn_ends_the_response_keeping_what_was_sampled(tokenizer, prompt, finish):
    engine = ScriptedEngine(tokenizer, [(CALL.format("1+1"), "stop"), ("partial", finish)])
    response = run(engine, tokenizer, prompt)
    error = REFUSAL if finish == "error" else None
    assert (response.finish_reason, response.error, response.turns) == (finish, error, 2)
    assert len(response.token_ids) == len(response.loss_mask) == len(response.logprobs)
    assert response.loss_mask[-1] == (1 if finish == "abort" else 0)  # a refused request sampled nothing


def test_logprobs_that_do_not_match_the_tokens_and_settings_that_cannot_work_are_refused(tokenizer, prompt):
    async def broken(input_ids, sampling):
        return ScriptedTurn([1, 2, 3], [-0.5], "stop")

    with pytest.raises(ValueError, match="3 token ids but 1 logprobs"):
        asyncio.run(generate_multi_turn(broken, prompt, SamplingConfig(), ChatTurns(tokenizer), TOOLS, max_turns=2))
    with pytest.raises(ValueError, match="max_turns=0"):
        asyncio.run(generate_multi_turn(broken, prompt, SamplingConfig(), ChatTurns(tokenizer), TOOLS, max_turns=0))
    with pytest.raises(ValueError, match="ignore_eos"):
        asyncio.run(generate_multi_turn(
            broken, prompt, SamplingConfig(ignore_eos=True), ChatTurns(tokenizer), TOOLS, max_turns=2
        ))


class PieceEngine:
    """Answers request k with pieces[k], (token ids, finish reason); a token's logprob follows from its id, so a turn
    sampled in two requests (cut by an abort) has the logprobs it has sampled in one."""

    def __init__(self, pieces: list[tuple[list[int], str]]):
        self.pieces, self.requests = pieces, []

    async def __call__(self, input_ids, sampling):
        self.requests.append((list(input_ids), sampling))
        token_ids, finish = self.pieces[len(self.requests) - 1]
        return ScriptedTurn(token_ids, [-token / 1000 for token in token_ids], finish)


class CountingCalculator(Calculator):
    def __init__(self):
        self.calls = 0

    def __call__(self, arguments):
        self.calls += 1
        return super().__call__(arguments)


@pytest.mark.parametrize("max_turns, counts",
                         [(4, ToolUse(turns=3, tool_calls=2)), (2, ToolUse(turns=2, tool_calls=1))])
@pytest.mark.parametrize("turn, cut", [(0, 0.5), (1, 0.5), (1, 0.0), (0, 0.0)],
                         ids=["mid-call in the first turn", "mid-call after a tool turn",
                              "before the turn after a tool turn", "before the first token"])
def test_a_response_aborted_and_continued_is_the_response_sampled_without_the_abort(
        tokenizer, prompt, turn, cut, max_turns, counts):
    """Partial rollout: the abort cuts turn `turn` after `cut` of its ids (a cut call spans the two requests, so its
    parse must read the whole turn); the continuation finishes that turn and goes on."""
    script = [tokenizer.encode(text, add_special_tokens=False) for text in
              (CALL.format("1+1"), CALL.format("2+3"), "5<|im_end|>")]
    whole_calculator = CountingCalculator()
    whole = run(PieceEngine([(ids, "stop") for ids in script]), tokenizer, prompt, max_turns=max_turns,
                tools={"calculator": whole_calculator})

    k = int(len(script[turn]) * cut)
    before = PieceEngine([(ids, "stop") for ids in script[:turn]] + [(script[turn][:k], "abort")])
    calculator = CountingCalculator()
    aborted = run(before, tokenizer, prompt, max_turns=max_turns, tools={"calculator": calculator})
    kept = list(aborted.token_ids)
    assert (aborted.finish_reason, aborted.turns) == ("abort", turn + 1)  # the cut turn counted when it began
    after = PieceEngine([(script[turn][k:], "stop")] + [(ids, "stop") for ids in script[turn + 1:]])
    continued = run(after, tokenizer, prompt, max_turns=max_turns, tools={"calculator": calculator}, so_far=aborted)

    first_input, first_sampling = after.requests[0]
    assert first_input == prompt + kept and first_sampling.max_new_tokens == 400 - len(kept)  # token in, the budget
    assert continued.token_ids[:len(kept)] == kept
    assert (continued.token_ids, continued.loss_mask, continued.logprobs) == \
        (whole.token_ids, whole.loss_mask, whole.logprobs)
    assert (continued.finish_reason, continued.counts()) == (whole.finish_reason, whole.counts())
    assert whole.counts() == counts
    assert calculator.calls == whole_calculator.calls  # a call answered before the abort is not run again
