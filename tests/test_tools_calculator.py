"""The calculator tool: correct arithmetic, integers printed as integers, no `eval`, hostile input
(huge powers, deep nesting, names, calls) refused quickly with a message for the model, and the
schema the tiny model was trained with."""

from __future__ import annotations

import ast
import builtins
import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop.tasks import arithmetic
from agentloop.tools import ToolContext, ToolRegistry
from agentloop.tools.builtin import calculator
from agentloop.tools.builtin.calculator import CalculatorError, CalculatorTool, evaluate, format_number
from agentloop.tools.parsers import ToolCall


@pytest.mark.parametrize(
    "expr, expected",
    [
        ("12 * 33", "396"),
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("-5 + +3", "-2"),
        ("-(2 - 7) * 4", "20"),
        ("792 / 2", "396"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("0.1 + 0.2", "0.3"),
        ("1.5e3 * 2", "3000"),
        ("12 × 3 ÷ 4", "9"),
        ("  3  ", "3"),
        ("123456789 * 987654321", "121932631112635269"),
    ],
)
def test_arithmetic(expr, expected):
    assert format_number(evaluate(expr)) == expected


@pytest.mark.parametrize(
    "expr, fragment",
    [
        ("__import__('os').system('id')", "unsupported element"),
        ("open('/etc/passwd')", "unsupported element"),
        ("x + 1", "unsupported element 'x'"),
        ("(1).__class__", "unsupported element"),
        ("lambda: 1", "unsupported element"),
        ("[1, 2]", "unsupported element"),
        ("'a' * 3", "unsupported constant 'a'"),
        ("True + 1", "unsupported constant True"),
        ("2 ^ 3", "use ** for powers"),
        ("1 << 5", "unsupported operator '<<'"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "fractional power"),
        ("1 +", "cannot parse"),
        ("", "empty"),
        ("1e308 * 10", "too large"),
    ],
)
def test_refusals_are_messages(expr, fragment):
    with pytest.raises(CalculatorError) as e:
        evaluate(expr)
    assert fragment in str(e.value)


@pytest.mark.parametrize("expr", ["9 ** 9 ** 9", "2 ** 100000", "10 ** 101", "(10 ** 50) * (10 ** 51)", "99999999999 ** 999",
                                  "2 ** 2 ** 2 ** 2 ** 2 ** 2"])
def test_huge_results_refused_before_computing(expr, monkeypatch):
    # Every operation the calculator performs is recorded: a huge power must be refused from its
    # operands, so nothing far beyond the result limit (1e100) is ever computed.
    computed = []

    def recording(op):
        def run(a, b):
            computed.append(op(a, b))
            return computed[-1]
        return run

    monkeypatch.setattr(calculator, "_BINOPS", {k: recording(op) for k, op in calculator._BINOPS.items()})
    with pytest.raises(CalculatorError, match="too large"):
        evaluate(expr)
    assert all(abs(v) < 10 ** 202 for v in computed), [len(str(v)) for v in computed]


def test_size_and_depth_caps():
    with pytest.raises(CalculatorError, match="too long"):
        evaluate("1+" * 600 + "1")
    with pytest.raises(CalculatorError, match="nested too deeply"):
        evaluate("(1 + " * 60 + "1" + ")" * 60)
    assert evaluate("(" * 60 + "1" + ")" * 60) == 1  # parentheses alone add no depth
    with pytest.raises(CalculatorError, match="nested too deeply"):
        evaluate("-" * 200 + "1")
    with pytest.raises(CalculatorError, match="must be a string"):
        evaluate(12)  # type: ignore[arg-type]


def test_no_eval_or_exec_anywhere(monkeypatch):
    tree = ast.parse(inspect.getsource(calculator))
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__"}  # (ast.parse only parses)

    def forbidden(*a, **k):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert format_number(evaluate("(3 + 4) * 5 ** 2 // 3")) == "58"


def test_schema_is_the_training_schema():
    assert CalculatorTool().schema == arithmetic.CALCULATOR_TOOL


small_int = st.integers(min_value=0, max_value=999)


@st.composite
def task_expressions(draw):
    """Expressions in the arithmetic task's format: integers, + - *, spaces, optional parentheses."""
    expr = str(draw(small_int))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["+", "-", "*"]))
        rhs = str(draw(small_int))
        expr = f"({expr}) {op} {rhs}" if draw(st.booleans()) else f"{expr} {op} {rhs}"
    return expr


@settings(max_examples=200, deadline=None)
@given(task_expressions())
def test_agrees_with_the_task_grader(expr):
    assert format_number(evaluate(expr)) == arithmetic.format_result(arithmetic.evaluate_expression(expr))


async def test_through_the_registry_errors_reach_the_model():
    reg = ToolRegistry([CalculatorTool()])
    res = await reg.execute_calls(
        [ToolCall("calculator", {"expression": "12 * 33"}, ""), ToolCall("calculator", {"expression": "9**9**9"}, ""),
         ToolCall("calculator", {"expression": 5}, "")],
        context=ToolContext("t"), timeout=5, max_parallel=2,
    )
    assert res[0].content == "396" and res[0].ok
    assert res[1].content.startswith("Error: exponent 387420489 too large") and res[1].error_kind == "exception"
    assert res[2].error_kind == "bad_arguments" and "is not of type 'string'" in res[2].content
