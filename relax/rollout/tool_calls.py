"""Tool calls in what a model wrote, in Qwen's format, and running them with relax's tools (relax/rollout/tools.py).

A call is a <tool_call> block holding a JSON object {"name": <tool name>, "arguments": <object>}; a turn may hold
several. Calls the model writes inside its thinking block are thoughts, not calls: only the text after the last
</think> is read. A block that is not such an object (bad JSON, no name, arguments not an object, no closing tag)
is still a call: it fails, and its error text goes back to the model in the tool turn, as a tool's own failure does,
so the model can learn the format from it and the rollout counts it.

    calls = parse_tool_calls(text)
    outputs = await run_tool_calls(calls, {tool.name: tool for tool in (Calculator(), PythonTool())})
"""

import asyncio
import json
import re
from dataclasses import dataclass

from relax.rollout.tools import Tool, ToolOutput

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_CLOSE = "</think>"
CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + "(.*?)(" + re.escape(CALL_CLOSE) + "|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str = ""
    arguments: dict | None = None
    error: str | None = None  # why the block is not a call; the model reads it as the call's output


@dataclass
class ToolUse:
    """What a sample's multi-turn rollout did besides sampling: what its rollout/ metrics count."""

    turns: int = 0  # assistant turns, each an engine request (a turn continued after an abort: one turn)
    tool_calls: int = 0  # calls run, malformed ones included
    tool_failures: int = 0  # calls whose output is failed: malformed, unknown tool, tool error, timeout
    tool_timeouts: int = 0  # of those, the tool's wall-clock limit

    def counts(self) -> "ToolUse":
        """The counts alone (a MultiTurnResponse's, without its tokens)."""
        return ToolUse(self.turns, self.tool_calls, self.tool_failures, self.tool_timeouts)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in a turn's text (decoded with its special tokens), in the order written."""
    answer = text[_answer_start(text):]
    return [_parse_call(body, closed=bool(close)) for body, close in CALL_BLOCK.findall(answer)]


def text_before_tool_calls(text: str) -> str:
    """A turn's text up to its first tool call (its thinking block kept), where parse_tool_calls reads the calls."""
    start = _answer_start(text)
    call = text.find(CALL_OPEN, start)
    return text if call < 0 else text[:call]


def _answer_start(text: str) -> int:
    """Where a turn's answer begins: after its last thinking block, whose text is not read for calls."""
    think_end = text.rfind(THINK_CLOSE)
    return 0 if think_end < 0 else think_end + len(THINK_CLOSE)


def _parse_call(body: str, closed: bool) -> ToolCall:
    expected = 'a tool call is <tool_call>{"name": <tool name>, "arguments": <object>}</tool_call>'
    if not closed:
        return ToolCall(error=f"the tool call has no {CALL_CLOSE}; {expected}")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(error=f"the tool call is not JSON ({error}); {expected}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error=f"the tool call names no tool; {expected}")
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCall(name=call["name"], error=f"the arguments of {call['name']} are not an object; {expected}")
    return ToolCall(name=call["name"], arguments=arguments)


async def run_tool_calls(calls: list[ToolCall], tools: dict[str, Tool]) -> list[ToolOutput]:
    """Each call's output, in call order. The calls run at once, each in a thread: a tool blocks (the Python tool
    waits on its sandbox), and the rollout's event loop goes on meanwhile. Nothing raises: a malformed call, an
    unknown tool, a tool that raised or returned neither a ToolOutput nor a str gives failed output saying so."""
    return list(await asyncio.gather(*(_run_call(call, tools) for call in calls)))


async def _run_call(call: ToolCall, tools: dict[str, Tool]) -> ToolOutput:
    if call.error is not None:
        return ToolOutput(f"error: {call.error}", failed=True)
    tool = tools.get(call.name)
    if tool is None:
        return ToolOutput(f"error: there is no tool {call.name!r}; the tools are {sorted(tools)}", failed=True)
    try:
        output = await asyncio.to_thread(tool, call.arguments)
    except Exception as error:  # a user's tool that broke the Tool contract: the rollout goes on
        return ToolOutput(f"error: {call.name} raised {type(error).__name__}: {error}", failed=True)
    if isinstance(output, str):  # a user's tool may return its text alone
        return ToolOutput(output)
    if not isinstance(output, ToolOutput):
        return ToolOutput(f"error: {call.name} returned {type(output).__name__}, not a ToolOutput or str", failed=True)
    return output
