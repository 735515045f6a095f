"""The `calculator` tool: safe arithmetic evaluation by walking an `ast` tree (never `eval`).

Numbers, `+ - * / // % **`, unary `+ -` and parentheses. Caps keep hostile input cheap: expression
length, nesting depth, exponent size, and the magnitude of every intermediate value (checked *before*
a power is computed, so `9**9**9` is refused instantly). Errors come back as text for the model.
Its schema is the one the tiny model was trained with (`agentloop.tasks.arithmetic.CALCULATOR_TOOL`).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from ...tasks.arithmetic import CALCULATOR_TOOL
from ..base import Tool, ToolContext, ToolError

__all__ = ["CalculatorTool", "CalculatorError", "evaluate", "format_number"]

Number = int | float


class CalculatorError(ToolError, ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is meant for the model."""


_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
           ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>", ast.MatMult: "@"}


def format_number(value: Number) -> str:
    """Integers (and floats with an integral value) print as integers, e.g. "396"; others with 12
    significant digits so 0.1 + 0.2 reads 0.3."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        return format(value, ".12g")
    return str(value)


def evaluate(expression: str, *, max_chars: int = 1000, max_depth: int = 50, max_exponent: int = 1000,
             max_abs: float = 1e100) -> Number:
    """Evaluate `expression` or raise `CalculatorError` naming what was wrong."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    src = expression.strip()
    if not src:
        raise CalculatorError("expression is empty")
    if len(src) > max_chars:
        raise CalculatorError(f"expression too long ({len(src)} > {max_chars} characters)")
    src = src.replace("×", "*").replace("÷", "/").replace("−", "-")
    try:
        tree = ast.parse(src, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"cannot parse {expression!r}: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"cannot parse {expression!r}") from None

    def check(v: Number) -> Number:
        if isinstance(v, float) and not math.isfinite(v):
            raise CalculatorError("result is not a finite number")
        if abs(v) > max_abs:
            raise CalculatorError(f"result too large (magnitude above {max_abs:g})")
        return v

    def walk(node: ast.AST, depth: int) -> Number:
        if depth > max_depth:
            raise CalculatorError(f"expression nested too deeply (more than {max_depth} levels)")
        if isinstance(node, ast.Constant):
            if type(node.value) in (int, float):
                return check(node.value)
            raise CalculatorError(f"unsupported constant {node.value!r}; only numbers are allowed")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = walk(node.operand, depth + 1)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp):
            op = _BINOPS.get(type(node.op))
            if op is None:
                sym = _SYMBOL.get(type(node.op), type(node.op).__name__)
                hint = " (use ** for powers)" if sym == "^" else ""
                raise CalculatorError(f"unsupported operator {sym!r}{hint}; allowed: + - * / // % **")
            left, right = walk(node.left, depth + 1), walk(node.right, depth + 1)
            if isinstance(node.op, ast.Pow):
                _check_power(left, right, max_exponent, max_abs)
            try:
                return check(op(left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result too large") from None
        seg = ast.get_source_segment(src, node) or type(node).__name__
        raise CalculatorError(f"unsupported element {seg!r}; only numbers, + - * / // % ** and parentheses are allowed")

    return walk(tree.body, 0)


def _check_power(base: Number, exp: Number, max_exponent: int, max_abs: float) -> None:
    """Refuse a power before computing it if the exponent or the result would be too large."""
    if abs(exp) > max_exponent:
        raise CalculatorError(f"exponent {format_number(exp)} too large (limit {max_exponent})")
    if base == 0 and exp < 0:
        raise CalculatorError("division by zero (0 to a negative power)")
    if base < 0 and isinstance(exp, float) and not exp.is_integer():
        raise CalculatorError("negative number to a fractional power")
    if abs(base) > 1 and exp > 0 and exp * math.log10(abs(base)) > math.log10(max_abs):
        raise CalculatorError(f"result too large (magnitude above {max_abs:g})")


class CalculatorTool(Tool):
    """Evaluates one arithmetic expression (argument `expression`) and returns the number as text."""

    name = CALCULATOR_TOOL["function"]["name"]
    description = CALCULATOR_TOOL["function"]["description"]
    parameters = CALCULATOR_TOOL["function"]["parameters"]
    isolation = "inline"  # pure, bounded, ours: no worker process needed

    def __init__(self, *, max_chars: int = 1000, max_depth: int = 50, max_exponent: int = 1000, max_abs: float = 1e100) -> None:
        self.limits = {"max_chars": max_chars, "max_depth": max_depth, "max_exponent": max_exponent, "max_abs": max_abs}

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        # A CalculatorError is a ToolError: the registry answers the model with "Error: <why>".
        return format_number(evaluate(arguments.get("expression", ""), **self.limits))
