"""The synthetic arithmetic tool-use task: questions, the `calculator` tool, answers and grading.

This module owns everything about the task that more than one place needs, so they agree:
- the question generator (integers of 1 to 3 digits, operators ``+ - *``, one to three operations,
  several phrasings; some questions need two chained calculator calls),
- the expression format the assistant passes to the tool (``"12 + 34 * 5"``: single spaces around
  binary operators, standard precedence),
- the OpenAI function schema of the ``calculator`` tool (:data:`CALCULATOR_TOOL`) and a safe
  evaluator for its expressions (:func:`evaluate_expression`, no ``eval``),
- the reference conversation in OpenAI message format (:func:`reference_messages`), used to train
  the shipped tiny model,
- the final-answer form ``The answer is N.`` (:func:`extract_final_answer`) and the correctness
  check (:func:`is_correct`) used by evaluation and rewards.

It imports nothing from the rest of agentloop (it is a leaf), and nothing here does I/O.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "CALCULATOR_TOOL",
    "TOOL_NAME",
    "ArithmeticQuestion",
    "ExpressionError",
    "FollowUp",
    "evaluate_expression",
    "extract_final_answer",
    "final_answer_text",
    "format_result",
    "generate_question",
    "generate_questions",
    "is_correct",
    "reference_messages",
]

TOOL_NAME = "calculator"

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression on integers with + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "The expression to evaluate, e.g. 12 + 34 * 5",
                }
            },
            "required": ["expression"],
        },
    },
}
"""OpenAI-style function schema of the calculator; the tiny model was trained with exactly this."""

Op = Literal["+", "-", "*"]
_OPS: tuple[Op, ...] = ("+", "-", "*")

# Limits of the evaluator: generous for the task (three 3-digit operands, chained twice), tight
# enough that a hostile expression like 9**9**9 or a 10k-character string cannot burn the CPU.
MAX_EXPRESSION_CHARS = 200
MAX_ABS_VALUE = 10**18


class ExpressionError(ValueError):
    """An expression the calculator refuses; the message names the offending part."""


def evaluate_expression(expression: str) -> int:
    """Evaluate an integer expression with ``+ - *``, unary minus and parentheses.

    Parsed with :mod:`ast` and walked explicitly; anything else (names, calls, ``/``, ``**``,
    floats, huge values) raises :class:`ExpressionError` naming what was found.
    """
    if not isinstance(expression, str):
        raise ExpressionError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression too long ({len(expression)} > {MAX_EXPRESSION_CHARS} characters)")
    if not expression.strip():
        raise ExpressionError("expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ExpressionError(f"cannot parse expression {expression!r}: {e.msg}") from None
    return _eval_node(tree.body, expression)


def _eval_node(node: ast.AST, src: str) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _eval_node(node.operand, src)
        value = -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = _eval_node(node.left, src), _eval_node(node.right, src)
        if isinstance(node.op, ast.Add):
            value = left + right
        elif isinstance(node.op, ast.Sub):
            value = left - right
        else:
            value = left * right
    else:
        what = ast.get_source_segment(src.strip(), node) or type(node).__name__
        raise ExpressionError(f"unsupported element {what!r} in expression {src!r} (only integers, + - * and parentheses)")
    if abs(value) > MAX_ABS_VALUE:
        raise ExpressionError(f"value out of range in expression {src!r}")
    return value


def format_result(value: int) -> str:
    """How the calculator tool reports a value to the model (the tool message content)."""
    return str(value)


def final_answer_text(value: int) -> str:
    """The assistant's final message for an answer."""
    return f"The answer is {value}."


_FINAL_RE = re.compile(r"The answer is (-?\d+)\.")


def extract_final_answer(text: str) -> int | None:
    """The integer of the last ``The answer is N.`` in ``text``, or None if there is none."""
    matches = _FINAL_RE.findall(text)
    return int(matches[-1]) if matches else None


@dataclass(frozen=True)
class FollowUp:
    """A second step applied to the first result ``r``: ``r op operand`` (or ``operand op r``)."""

    op: Op
    operand: int
    result_first: bool = True

    def expression(self, previous: int) -> str:
        a, b = (previous, self.operand) if self.result_first else (self.operand, previous)
        return f"{a} {self.op} {b}"


@dataclass(frozen=True)
class ArithmeticQuestion:
    """One question: the user text, the first expression and optional chained follow-ups.

    ``expected_calls()`` lists the calculator expressions a correct assistant makes, in order; each
    follow-up's expression contains the previous call's result, so it needs a second tool call.
    """

    question: str
    expression: str
    followups: tuple[FollowUp, ...] = field(default=())

    def expected_calls(self) -> list[str]:
        calls = [self.expression]
        value = evaluate_expression(self.expression)
        for f in self.followups:
            calls.append(f.expression(value))
            value = evaluate_expression(calls[-1])
        return calls

    @property
    def answer(self) -> int:
        return evaluate_expression(self.expected_calls()[-1])

    @property
    def num_calls(self) -> int:
        return 1 + len(self.followups)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for datasets): question, answer and the expected calls."""
        return {"question": self.question, "answer": self.answer, "expected_calls": self.expected_calls()}


def is_correct(text: str, answer: int) -> bool:
    """True iff the last ``The answer is N.`` in ``text`` states ``answer``."""
    got = extract_final_answer(text)
    return got is not None and got == answer


# ---------------------------------------------------------------------------------------------
# Question generator
# ---------------------------------------------------------------------------------------------

_WORDS: dict[Op, tuple[str, ...]] = {
    "+": ("plus",),
    "-": ("minus",),
    "*": ("times", "multiplied by"),
}

_SINGLE_TEMPLATES = (
    "What is {e}?",
    "Compute {e}.",
    "Calculate {e}.",
    "How much is {e}?",
    "What is the value of {e}?",
    "Evaluate {e}.",
    "Please compute {e}.",
    "Can you calculate {e}?",
    "What does {e} equal?",
    "Work out {e}.",
)

_FIRST_STEP = ("Compute {e}", "Calculate {e}", "Work out {e}", "First compute {e}", "Take {e}")

_FOLLOWUP_PHRASES: dict[tuple[Op, bool], tuple[str, ...]] = {
    ("*", True): ("multiply the result by {b}", "multiply it by {b}"),
    ("+", True): ("add {b} to the result", "add {b} to it"),
    ("-", True): ("subtract {b} from the result", "subtract {b} from it"),
    ("-", False): ("subtract the result from {b}",),
}

_JOINERS = ("{first} and then {then}.", "{first}, then {then}.", "{first}. Then {then}.")


def _operand(rng: random.Random) -> int:
    digits = rng.choice((1, 2, 3))
    return rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _expression(rng: random.Random, n_ops: int) -> tuple[str, str]:
    """A random expression as (tool form, user form); the user form may spell operators in words."""
    nums = [_operand(rng) for _ in range(n_ops + 1)]
    ops = [rng.choice(_OPS) for _ in range(n_ops)]
    words = rng.random() < 0.35
    tool = str(nums[0])
    user = str(nums[0])
    for op, n in zip(ops, nums[1:]):
        tool += f" {op} {n}"
        user += f" {rng.choice(_WORDS[op]) if words else op} {n}"
    return tool, user


def generate_question(rng: random.Random, *, multi_call_fraction: float = 0.3) -> ArithmeticQuestion:
    """One random question; with probability ``multi_call_fraction`` it needs two calculator calls.

    Single-call questions have one to three operations; two-call questions have one or two in the
    first expression plus one chained operation on its result (so at most three in all).
    """
    if rng.random() < multi_call_fraction:
        tool, user = _expression(rng, rng.choice((1, 1, 2)))
        op = rng.choice(_OPS)
        result_first = True if op != "-" else rng.random() < 0.7
        follow = FollowUp(op=op, operand=_operand(rng), result_first=result_first)
        then = rng.choice(_FOLLOWUP_PHRASES[(op, result_first)]).format(b=follow.operand)
        first = rng.choice(_FIRST_STEP).format(e=user)
        text = rng.choice(_JOINERS).format(first=first, then=then)
        return ArithmeticQuestion(question=text, expression=tool, followups=(follow,))
    tool, user = _expression(rng, rng.choice((1, 2, 3)))
    return ArithmeticQuestion(question=rng.choice(_SINGLE_TEMPLATES).format(e=user), expression=tool)


def generate_questions(n: int, seed: int, *, multi_call_fraction: float = 0.3) -> list[ArithmeticQuestion]:
    """``n`` questions from a seeded generator (same seed, same questions, on every platform)."""
    rng = random.Random(seed)
    return [generate_question(rng, multi_call_fraction=multi_call_fraction) for _ in range(n)]


def reference_messages(q: ArithmeticQuestion, *, system: str | None = None) -> list[dict[str, Any]]:
    """The ideal conversation in OpenAI chat format: calculator call(s), tool result(s), answer.

    Tool calls carry ``arguments`` as a dict (what chat templates render with ``tojson``); each
    tool message has ``name`` and ``tool_call_id`` as OpenAI clients send them.
    """
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": q.question})
    for i, expr in enumerate(q.expected_calls()):
        call_id = f"call_{i}"
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": expr}}}
                ],
            }
        )
        messages.append(
            {"role": "tool", "tool_call_id": call_id, "name": TOOL_NAME, "content": format_result(evaluate_expression(expr))}
        )
    messages.append({"role": "assistant", "content": final_answer_text(q.answer)})
    return messages
