"""Tools a multi-turn rollout lets the model call: a calculator and a Python executor.

A tool takes the arguments the model wrote (a dict parsed from its tool call) and returns a ToolOutput: the text
the model reads in the tool turn and whether the call failed. A tool never raises for what the model wrote: bad
arguments, an exception in the code, a timeout, a limit hit or output cut short all come back as failed output
with the reason in its text, so the model can read it and the rollout can count it. (A user's tool may return its
text as a str, and one that raises anyway fails that call alone: relax.rollout.tool_calls.)

    calculator = Calculator()
    calculator({"expression": "2 ** 10 / 4"})            # ToolOutput(text="256.0", failed=False)
    python = PythonTool(PythonLimits(timeout_s=5))
    python({"code": "print(sum(range(10)))"})            # ToolOutput(text="45\n", failed=False)

load_tools makes the tools a rollout offers from their names: the built-ins by name, a user's tool by
`module:function` (or slime's dotted `module.path.function`) naming a Tool object, or a Tool class made with no
arguments; tool_schema gives each to the chat template.

The Python tool runs each call in a process of its own inside Linux namespaces (relax/rollout/tool_sandbox.py: no
network, every file system read-only but a size-limited scratch directory that vanishes with the call, no device
but null/zero/random/urandom, no capabilities), with limits on memory, CPU time, file size, wall-clock time and
output. It needs unprivileged user namespaces and util-linux's `unshare`; python_sandbox_problem() says why they
are missing, for a check before a run starts.
"""

import ast
import inspect
import math
import operator
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from relax.rollout.user_functions import import_user_function


@dataclass(frozen=True)
class ToolOutput:
    text: str  # what the model reads in the tool turn
    failed: bool = False  # bad arguments, an error, a timeout, a limit hit, output cut: the text says which
    timed_out: bool = False  # failed for the wall-clock limit (counted apart: a tool too slow for its limit)


class Tool(Protocol):
    name: str
    description: str
    parameters: dict  # the JSON schema of the arguments

    def __call__(self, arguments: dict) -> ToolOutput | str: ...


def tool_schema(tool: Tool) -> dict:
    """The tool as chat templates take it (`tools=[...]`, the OpenAI function format)."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def _string_argument(tool: Tool, arguments, key: str) -> str | ToolOutput:
    """arguments[key] as a string, or the failed output that names what the call should look like."""
    if not isinstance(arguments, dict) or not isinstance(arguments.get(key), str):
        return ToolOutput(f"{tool.name} takes {{\"{key}\": a string}}, got {arguments!r:.200}", failed=True)
    return arguments[key]


# --- calculator ----------------------------------------------------------------------------------------

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
FUNCTIONS = {name: getattr(math, name) for name in (
    "sqrt", "exp", "log", "log2", "log10", "sin", "cos", "tan", "asin", "acos", "atan", "floor", "ceil", "factorial",
    "gcd", "comb", "perm",
)} | {"abs": abs, "round": round, "min": min, "max": max}
CONSTANTS = {"pi": math.pi, "e": math.e}
MAX_INTEGER_BITS = 4096  # an integer result or operand past this is refused (10 ** 10 ** 10 must not hang a rollout)


class Calculator:
    name = "calculator"
    description = "Evaluate an arithmetic expression: + - * / // % **, parentheses, math functions and pi, e."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * sqrt(2)"}},
        "required": ["expression"],
    }

    def __call__(self, arguments: dict) -> ToolOutput:
        expression = _string_argument(self, arguments, "expression")
        if isinstance(expression, ToolOutput):
            return expression
        try:
            return ToolOutput(str(self.evaluate(ast.parse(expression, mode="eval").body)))
        except (SyntaxError, ValueError, TypeError, ArithmeticError) as error:
            return ToolOutput(f"error: {type(error).__name__}: {error}", failed=True)

    def evaluate(self, node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name) and node.id in CONSTANTS:
            return CONSTANTS[node.id]
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](self.evaluate(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            left, right = self.evaluate(node.left), self.evaluate(node.right)
            if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right * abs(left).bit_length() > MAX_INTEGER_BITS:
                    raise ValueError(f"{left} ** {right} is too large")
            return _bounded(BINARY[type(node.op)](left, right))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
                and not node.keywords):
            if node.func.id == "factorial" and self.evaluate(node.args[0]) > 1000:
                raise ValueError("factorial of more than 1000 is too large")
            return _bounded(FUNCTIONS[node.func.id](*(self.evaluate(argument) for argument in node.args)))
        raise ValueError(f"not allowed in an expression: {ast.unparse(node)!r}")


def _bounded(value):
    if isinstance(value, int) and value.bit_length() > MAX_INTEGER_BITS:
        raise ValueError(f"a result of {value.bit_length()} bits is too large")
    return value


# --- Python ---------------------------------------------------------------------------------------------

SANDBOX = Path(__file__).with_name("tool_sandbox.py")
NAMESPACES = ("unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child",
              "--mount-proc")
SANDBOX_FAILED = 3  # tool_sandbox.py's exit status when the sandbox could not be made


@dataclass(frozen=True)
class PythonLimits:
    timeout_s: float = 10.0  # wall clock, the sandbox's start included
    memory_bytes: int = 1 << 30  # address space
    cpu_seconds: int = 10
    scratch_bytes: int = 64 << 20  # the scratch directory's tmpfs
    file_bytes: int = 16 << 20  # the largest file the code may write
    output_chars: int = 4096  # stdout and stderr together; past it the output is cut and the call failed


class PythonTool:
    name = "python"
    description = (
        "Run Python 3 code and return what it prints (stdout and stderr). No network; files only in the working "
        "directory, which is empty at the start of every call."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a Python program; print what you need"}},
        "required": ["code"],
    }

    def __init__(self, limits: PythonLimits = PythonLimits()):
        self.limits = limits

    def __call__(self, arguments: dict) -> ToolOutput:
        code = _string_argument(self, arguments, "code")
        if isinstance(code, ToolOutput):
            return code
        limits = self.limits
        scratch = tempfile.mkdtemp(prefix="relax-tool-")  # only a mount point: the code's files live in the tmpfs
        try:
            process = subprocess.Popen(
                [*NAMESPACES, sys.executable, "-I", "-u", str(SANDBOX), scratch, str(limits.scratch_bytes),
                 str(limits.memory_bytes), str(limits.cpu_seconds), str(limits.file_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                env={"PATH": os.defpath, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"},
            )
            output = _BoundedOutput(process, limits.output_chars)
            try:
                process.stdin.write(code.encode())
                process.stdin.close()
            except BrokenPipeError:  # the sandbox ended before reading the code; its output says why
                pass
            try:
                status = process.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                _kill(process)
                output.join()
                text = output.text() + f"\n[timed out after {limits.timeout_s:g} s]"
                return ToolOutput(text, failed=True, timed_out=True)
            output.join()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if output.cut:
            return ToolOutput(output.text() + f"\n[output cut at {limits.output_chars} characters]", failed=True)
        if status == SANDBOX_FAILED and output.text().startswith("relax tool sandbox: "):
            return ToolOutput(output.text(), failed=True)
        if status != 0:
            why = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
            return ToolOutput(output.text() + f"\n[{why}]", failed=True)
        return ToolOutput(output.text())


class _BoundedOutput:
    """The first `limit` characters' worth of a process's output, read on a thread; a process that writes more is
    killed (a flood must not fill the driver's memory or keep the call running)."""

    def __init__(self, process: subprocess.Popen, limit: int):
        self.process, self.limit = process, limit
        self.data, self.cut = bytearray(), False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        bound = 4 * self.limit  # a UTF-8 character is at most 4 bytes
        while chunk := self.process.stdout.read1(65536):
            self.data += chunk[: bound + 1 - len(self.data)]
            if len(self.data) > bound or len(self.text(cut=False)) > self.limit:
                self.cut = True
                _kill(self.process)
                break
        self.process.stdout.close()

    def join(self) -> None:
        self.thread.join()

    def text(self, cut: bool = True) -> str:
        text = self.data.decode(errors="replace")
        return text[: self.limit] if cut else text


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL the sandbox: `unshare --kill-child` and the PID namespace take every process of the call with it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def python_sandbox_problem() -> str | None:
    """Why the Python tool's sandbox cannot be made on this machine, with the fix; None when it can."""
    if shutil.which("unshare") is None:
        return "the python tool needs util-linux's `unshare` on PATH (apt-get install util-linux)"
    output = PythonTool(PythonLimits(timeout_s=30))({"code": "print('ok')"})
    if output.failed or output.text != "ok\n":
        return (
            f"the python tool's sandbox could not start ({output.text.strip()[:300]}): it needs unprivileged user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1; in a container, a seccomp profile that allows "
            "unshare and mount, e.g. docker run --security-opt seccomp=unconfined)"
        )
    return None


# --- the tools of a rollout ----------------------------------------------------------------------------

BUILTIN_TOOLS = {"calculator": Calculator, "python": PythonTool}


def load_tools(specs: list[str], flag: str) -> dict[str, Tool]:
    """The tools `specs` name (flag: the setting they came from, for errors), by the names the model calls them."""
    tools = {}
    for spec in specs:
        if spec in BUILTIN_TOOLS:
            tool = BUILTIN_TOOLS[spec]()
        else:
            found = import_user_function(spec, flag)
            tool = found() if inspect.isclass(found) else found
            problem = _not_a_tool(tool)
            if problem:
                raise ValueError(
                    f"{flag} {spec}: {problem}; a tool has a name (str), a description (str) and parameters (the JSON "
                    "schema of its arguments, of type object), and is called with the arguments as a dict, returning "
                    f"a ToolOutput or a str. Built-in tools: {', '.join(BUILTIN_TOOLS)}"
                )
        if tool.name in tools:
            raise ValueError(f"{flag}: two tools are named {tool.name!r}; the model calls a tool by its name")
        tools[tool.name] = tool
    return tools


def _not_a_tool(tool) -> str | None:
    for attribute in ("name", "description"):
        value = getattr(tool, attribute, None)
        if not isinstance(value, str) or not value:
            return f"its {attribute} is {value!r:.200}, not a non-empty string"
    parameters = getattr(tool, "parameters", None)
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        return f"its parameters are {parameters!r:.200}, not a JSON schema of type object"
    return None
