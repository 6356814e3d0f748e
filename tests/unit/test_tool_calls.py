import asyncio
import threading

from relax.rollout.tool_calls import ToolCall, parse_tool_calls, run_tool_calls
from relax.rollout.tools import Calculator, ToolOutput

TOOLS = {"calculator": Calculator()}


def call_text(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_several_calls_in_order_and_none_from_the_thinking_block():
    text = (
        "<think>\nmaybe " + call_text('{"name": "python", "arguments": {"code": "1"}}') + "</think>\n\nlet me see\n"
        + call_text('{"name": "calculator", "arguments": {"expression": "1+2"}}') + "\n"
        + call_text('{"name":"calculator","arguments":{"expression":"3*4"}}') + "<|im_end|>"
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "1+2"}), ToolCall("calculator", {"expression": "3*4"})
    ]
    assert parse_tool_calls("just an answer: 3<|im_end|>") == []
    assert parse_tool_calls(call_text('{"name": "calculator"}')) == [ToolCall("calculator", {})]


def test_a_malformed_call_is_a_call_with_the_reason():
    bad_json, no_name, bad_arguments, not_closed = parse_tool_calls(
        call_text('{"name": "calculator", "arguments": {"expression": "1+2"}')  # a brace short
        + call_text('{"tool": "calculator"}')
        + call_text('{"name": "calculator", "arguments": "1+2"}')
        + '<tool_call>\n{"name": "calculator", "arguments": {}}<|im_end|>'
    )
    assert "not JSON" in bad_json.error and bad_json.name == ""
    assert "names no tool" in no_name.error
    assert bad_arguments.name == "calculator" and "not an object" in bad_arguments.error
    assert "no </tool_call>" in not_closed.error
    for call in (bad_json, no_name, bad_arguments, not_closed):
        assert '<tool_call>{"name": <tool name>, "arguments": <object>}</tool_call>' in call.error


class Raising:
    name, description, parameters = "raising", "breaks its contract", {}

    def __call__(self, arguments):
        raise RuntimeError("boom")


class ReturningText:
    name, description, parameters = "text", "answers in a str", {}

    def __call__(self, arguments):
        return "plain text" if arguments.get("text") else 3


class Waiting:
    """Its calls return only once all of them wait at the same time: in threads of their own, not on the event loop
    (one call there would block it, and the barrier would break after its timeout)."""
    name, description, parameters = "waiting", "waits for the others", {}

    def __init__(self, calls: int):
        self.barrier = threading.Barrier(calls, timeout=30)

    def __call__(self, arguments):
        self.barrier.wait()
        return ToolOutput(str(arguments["n"]))


def test_outputs_in_call_order_and_every_failure_as_failed_output():
    calls = [
        ToolCall("calculator", {"expression": "2 ** 10"}),
        ToolCall("calculator", {"expression": "1 / 0"}),
        ToolCall("search", {"query": "x"}),
        ToolCall("raising", {}),
        ToolCall(error="the tool call is not JSON"),
        ToolCall("text", {"text": True}),
        ToolCall("text", {}),
    ]
    outputs = asyncio.run(run_tool_calls(calls, {**TOOLS, "raising": Raising(), "text": ReturningText()}))
    assert outputs[0] == ToolOutput("1024") and outputs[5] == ToolOutput("plain text")
    assert [output.failed for output in outputs] == [False, True, True, True, True, False, True]
    assert "ZeroDivisionError" in outputs[1].text
    assert outputs[2].text == "error: there is no tool 'search'; the tools are ['calculator', 'raising', 'text']"
    assert outputs[3].text == "error: raising raised RuntimeError: boom"
    assert outputs[4].text == "error: the tool call is not JSON"
    assert outputs[6].text == "error: text returned int, not a ToolOutput or str"
    assert not any(output.timed_out for output in outputs)


def test_the_calls_of_a_turn_run_at_once_off_the_event_loop():
    calls = [ToolCall("waiting", {"n": n}) for n in range(3)]
    outputs = asyncio.run(run_tool_calls(calls, {"waiting": Waiting(len(calls))}))
    assert [output.text for output in outputs] == ["0", "1", "2"]
