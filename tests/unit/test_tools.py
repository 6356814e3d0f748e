"""The calculator tool (relax.rollout.tools.Calculator): arithmetic only, bounded, failures as output."""

import pytest

from relax.rollout.tools import Calculator, PythonTool, ToolOutput, tool_schema


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
