"""The calculator tool (relax.rollout.tools.Calculator): arithmetic only, bounded, failures as output; the tools of a
rollout loaded by name (load_tools)."""

import pytest

from relax.rollout.tools import Calculator, PythonTool, ToolOutput, load_tools, tool_schema


@pytest.mark.parametrize("expression, value", [
    ("2 ** 10 / 4", "256.0"),
    ("(3 + 4) * 2 - -1", "15"),
    ("7 // 2 + 7 % 2", "4"),
    ("sqrt(16) + log10(1000)", "7.0"),
    ("max(3, 9, 4) * pi / pi", "9.0"),
    ("factorial(6)", "720"),
])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert Calculator()({"expression": expression}) == ToolOutput(value)


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os').system('true')", "not allowed in an expression"),
    ("open('/etc/passwd')", "not allowed in an expression"),
    ("(1).__class__", "not allowed in an expression"),
    ("10 ** 10 ** 10", "too large"),  # would hang the rollout computing it
    ("factorial(100000)", "too large"),
    ("1 / 0", "ZeroDivisionError"),
    ("2 +", "SyntaxError"),
    ("sqrt(-1)", "ValueError"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic_as_failed_output(expression, reason):
    output = Calculator()({"expression": expression})
    assert output.failed and reason in output.text, output


@pytest.mark.parametrize("tool, arguments", [
    (Calculator(), {"expr": "1"}), (Calculator(), "1 + 1"), (PythonTool(), {"code": 3}), (PythonTool(), None),
])
def test_arguments_of_the_wrong_shape_are_failed_output_naming_the_expected_shape(tool, arguments):
    output = tool(arguments)
    key = "expression" if isinstance(tool, Calculator) else "code"
    assert output.failed and f'{tool.name} takes {{"{key}": a string}}' in output.text


def test_a_tool_is_described_in_the_chat_templates_function_format():
    schema = tool_schema(Calculator())
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


USER_TOOLS = '''
from relax.rollout.tools import ToolOutput

SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}


class Search:
    name, description, parameters = "search", "look a word up", SCHEMA

    def __call__(self, arguments):
        return ToolOutput("found " + arguments["query"])


def lookup(arguments):
    return "looked up " + arguments["query"]


lookup.name, lookup.description, lookup.parameters = "lookup", "look a word up", SCHEMA
search = Search()


def undescribed(arguments):
    return ""


def no_schema(arguments):
    return ""


no_schema.name, no_schema.description, no_schema.parameters = "no_schema", "d", {"query": "a string"}
'''


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(USER_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_tools"


def test_tools_by_name_built_in_or_the_users_own(user_tools):
    tools = load_tools(["calculator", "python", "my_tools:Search", "my_tools.lookup"], "--tools")
    assert list(tools) == ["calculator", "python", "search", "lookup"]
    assert isinstance(tools["calculator"], Calculator) and isinstance(tools["python"], PythonTool)
    assert tools["search"]({"query": "x"}) == ToolOutput("found x")
    assert tools["lookup"]({"query": "x"}) == "looked up x"
    assert tool_schema(tools["lookup"])["function"]["parameters"]["required"] == ["query"]


@pytest.mark.parametrize("specs, reason", [
    (["my_tools:undescribed"], "--tools my_tools:undescribed: its name is None, not a non-empty string"),
    (["my_tools:no_schema"], "its parameters are {'query': 'a string'}, not a JSON schema of type object"),
    (["my_tools:missing"], "module 'my_tools' has no function 'missing'"),
    (["shell"], "name a function as module:function or module.path.function"),
    (["my_tools:search", "my_tools:Search"], "--tools: two tools are named 'search'"),
])
def test_what_is_not_a_tool_is_refused_saying_why(user_tools, specs, reason):
    with pytest.raises(ValueError) as refused:
        load_tools(specs, "--tools")
    assert reason in str(refused.value)
