"""ToolRegistry: errors for the model instead of exceptions (unknown tool, bad arguments, parse errors,
timeouts, raising tools), bounded parallelism measured from timestamps, per-trajectory state, YAML
config loading and its error messages."""

from __future__ import annotations

import textwrap
from typing import Any

import anyio
import pytest

from agentloop.tools import Tool, ToolConfigError, ToolContext, ToolError, ToolRegistry
from agentloop.tools.builtin.calculator import CalculatorTool
from agentloop.tools.parsers import ToolCall, get_parser


class SleepTool(Tool):
    """Sleeps `seconds` and records when it ran (anyio clock) so overlap can be measured."""

    name = "sleep"
    description = "sleep"
    parameters = {
        "type": "object",
        "properties": {"seconds": {"type": "number", "minimum": 0}, "tag": {"type": "string"}},
        "required": ["seconds"],
        "additionalProperties": False,
    }

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        start = anyio.current_time()
        try:
            if arguments["seconds"] == float("inf") or arguments["seconds"] > 1e6:
                await anyio.sleep_forever()
            await anyio.sleep(arguments["seconds"])
        finally:
            self.spans.append((start, anyio.current_time()))
        return f"slept {arguments.get('tag', '')}"


class BoomTool(Tool):
    name = "boom"
    description = "raises"
    parameters = {"type": "object", "properties": {"kind": {"type": "string"}}}

    async def execute(self, arguments, context):
        if arguments.get("kind") == "tool_error":
            raise ToolError("the widget is out of order")
        raise RuntimeError("kaboom\nsecond line of a long traceback")


class NumberTool(Tool):
    name = "number"
    parameters = {"type": "object", "properties": {}}

    async def execute(self, arguments, context):
        return 42  # not a str: the registry coerces


class StatefulTool(Tool):
    name = "counter"
    parameters = {"type": "object", "properties": {}}

    def __init__(self, fail_create: bool = False) -> None:
        self.fail_create = fail_create
        self.released: list[str] = []

    async def create_state(self, context):
        if self.fail_create:
            raise OSError("no sandbox slots")
        context.state[self.name] = 0

    async def release_state(self, context):
        self.released.append(context.trajectory_id)
        context.state.pop(self.name, None)

    async def execute(self, arguments, context):
        context.state[self.name] += 1
        return str(context.state[self.name])


def ctx(tid: str = "t0") -> ToolContext:
    return ToolContext(trajectory_id=tid)


def max_overlap(spans: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


async def test_schemas_names_and_lookup():
    reg = ToolRegistry([CalculatorTool(), SleepTool()])
    assert reg.names() == ["calculator", "sleep"] and len(reg) == 2 and "sleep" in reg
    s = reg.schemas()
    assert s[0]["type"] == "function" and s[0]["function"]["name"] == "calculator"
    assert set(s[0]["function"]) == {"name", "description", "parameters"}
    assert [x["function"]["name"] for x in reg.schemas(["sleep"])] == ["sleep"]
    with pytest.raises(KeyError, match="unknown tool 'nope'"):
        reg.get("nope")


async def test_errors_become_results_for_the_model_in_call_order():
    reg = ToolRegistry([CalculatorTool(), SleepTool(), NumberTool()])
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 33"}}</tool_call>'
        '<tool_call>{"name": "foo", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
        '<tool_call>{"name": "sleep", "arguments": {"seconds": "soon"}}</tool_call>'
        '<tool_call>{"name": "sleep", "arguments": {"seconds": 0, "extra": 1}}</tool_call>'
        "<tool_call>{oops}</tool_call>"
        '<tool_call>{"name": "number"}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
    )
    _, calls = get_parser("hermes").parse(text)
    res = await reg.execute_calls(calls, context=ctx(), timeout=5, max_parallel=4)
    assert [r.index for r in res] == list(range(8))
    assert [(r.ok, r.error_kind) for r in res] == [
        (True, None), (False, "unknown_tool"), (False, "bad_arguments"), (False, "bad_arguments"),
        (False, "bad_arguments"), (False, "parse"), (True, None), (False, "exception"),
    ]
    assert res[0].content == "396"
    assert res[1].content == "Error: unknown tool 'foo'; available: calculator, sleep, number"
    assert "'expression' is a required property" in res[2].content and "calculator" in res[2].content
    assert "seconds: 'soon' is not of type 'number'" in res[3].content
    assert "Additional properties are not allowed ('extra'" in res[4].content
    assert res[5].content.startswith("Error: could not parse tool call: invalid JSON")
    assert res[6].content == "42"
    assert res[7].content == "Error: division by zero"


async def test_hanging_tool_times_out_while_others_complete():
    tool = SleepTool()
    reg = ToolRegistry([tool])
    calls = [ToolCall("sleep", {"seconds": 1e9, "tag": "hang"}, ""), ToolCall("sleep", {"seconds": 0.05, "tag": "a"}, ""),
             ToolCall("sleep", {"seconds": 0.1, "tag": "b"}, "")]
    with anyio.fail_after(60):  # a guard against a hang, not a speed check
        res = await reg.execute_calls(calls, context=ctx(), timeout=0.5, max_parallel=3)
    assert res[0].ok is False and res[0].error_kind == "timeout"
    assert res[0].content == "Error: tool 'sleep' timed out after 0.5 seconds"
    assert [r.content for r in res[1:]] == ["slept a", "slept b"] and all(r.ok for r in res[1:])
    assert len(tool.spans) == 3  # the hanging call was cancelled (its finally ran), not leaked


async def test_raising_tool_returns_its_error_text(caplog):
    reg = ToolRegistry([BoomTool()])
    res = await reg.execute_calls(
        [ToolCall("boom", {}, ""), ToolCall("boom", {"kind": "tool_error"}, "")], context=ctx(), timeout=5, max_parallel=2
    )
    assert (res[0].ok, res[0].error_kind, res[0].content) == (False, "exception", "Error: RuntimeError: kaboom")
    assert (res[1].ok, res[1].error_kind, res[1].content) == (False, "exception", "Error: the widget is out of order")
    # the unexpected exception's traceback is logged for people (once), the ToolError is not
    logged = [r for r in caplog.records if r.name == "agentloop.tools.registry"]
    assert len(logged) == 1 and logged[0].exc_info[0] is RuntimeError


async def test_timeout_error_raised_inside_a_tool_is_not_our_timeout():
    class Inner(Tool):
        name = "inner"

        async def execute(self, arguments, context):
            raise TimeoutError

    res = await ToolRegistry([Inner()]).execute_calls([ToolCall("inner", {}, "")], context=ctx(), timeout=5, max_parallel=1)
    assert (res[0].error_kind, res[0].content) == ("exception", "Error: TimeoutError")


@pytest.mark.parametrize("max_parallel", [1, 2, 5])
async def test_max_parallel_is_honoured(max_parallel):
    tool = SleepTool()
    reg = ToolRegistry([tool])
    calls = [ToolCall("sleep", {"seconds": 0.05, "tag": str(i)}, "") for i in range(5)]
    res = await reg.execute_calls(calls, context=ctx(), timeout=5, max_parallel=max_parallel)
    assert [r.content for r in res] == [f"slept {i}" for i in range(5)]
    assert max_overlap(tool.spans) == max_parallel


async def test_bad_execute_arguments_raise():
    reg = ToolRegistry([SleepTool()])
    with pytest.raises(ValueError, match="max_parallel"):
        await reg.execute_calls([], context=ctx(), timeout=1, max_parallel=0)
    with pytest.raises(ValueError, match="timeout"):
        await reg.execute_calls([], context=ctx(), timeout=0, max_parallel=1)
    assert await reg.execute_calls([], context=ctx(), timeout=1, max_parallel=1) == []


async def test_results_truncated_by_tokens_when_asked():
    class CharTok:  # one token per character: enough to check the plumbing (tokens are tested elsewhere)
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(i) for i in ids)

    class Long(Tool):
        name = "long"

        async def execute(self, arguments, context):
            return "x" * 500

    reg = ToolRegistry([Long()])
    res = await reg.execute_calls([ToolCall("long", {}, "")], context=ctx(), timeout=1, max_parallel=1,
                                  tokenizer=CharTok(), max_result_tokens=60, truncate_side="right")
    assert res[0].truncated and len(res[0].content) <= 60 and res[0].content.startswith("xxx")
    assert "truncated" in res[0].content


async def test_per_trajectory_state_is_created_and_released():
    tool = StatefulTool()
    reg = ToolRegistry([tool, CalculatorTool()])
    a, b = ctx("a"), ctx("b")
    async with reg.trajectory(a), reg.trajectory(b):
        for _ in range(3):
            await reg.execute_calls([ToolCall("counter", {}, "")], context=a, timeout=1, max_parallel=1)
        r = await reg.execute_calls([ToolCall("counter", {}, "")], context=b, timeout=1, max_parallel=1)
        assert a.state["counter"] == 3 and r[0].content == "1"
    assert sorted(tool.released) == ["a", "b"] and "counter" not in a.state

    # cancellation of the trajectory still releases (release is shielded)
    c = ctx("c")
    with anyio.move_on_after(0.05):
        async with reg.trajectory(c):
            await anyio.sleep_forever()
    assert tool.released[-1] == "c"


async def test_failed_create_state_releases_the_others_and_names_the_tool():
    ok, bad = StatefulTool(), StatefulTool(fail_create=True)
    bad.name = "sandbox"
    reg = ToolRegistry([ok, bad])
    with pytest.raises(RuntimeError, match="tool 'sandbox': create_state failed for trajectory t9: no sandbox slots"):
        await reg.open_trajectory(ctx("t9"))
    assert ok.released == ["t9"]


def test_yaml_config_loads_with_schema_override(tmp_path):
    p = tmp_path / "tools.yaml"
    p.write_text(textwrap.dedent("""
        tools:
          - class_name: agentloop.tools.builtin.calculator.CalculatorTool
            config: {max_exponent: 10}
          - class_name: test_tools_registry.SleepTool
            tool_schema:
              type: function
              function:
                name: wait
                description: Wait a while.
                parameters: {type: object, properties: {seconds: {type: integer}}, required: [seconds]}
    """))
    reg = ToolRegistry.from_yaml(p)
    assert reg.names() == ["calculator", "wait"]
    assert reg.get("calculator").limits["max_exponent"] == 10
    assert reg.schemas(["wait"])[0]["function"] == {
        "name": "wait", "description": "Wait a while.",
        "parameters": {"type": "object", "properties": {"seconds": {"type": "integer"}}, "required": ["seconds"]},
    }
    assert reg.check_call(ToolCall("wait", {"seconds": 1.5}, ""))[0] == "bad_arguments"  # the override validates
    assert SleepTool.name == "sleep"  # overriding an instance leaves the class alone


def test_shipped_example_config_loads():
    from pathlib import Path

    reg = ToolRegistry.from_yaml(Path(__file__).resolve().parents[1] / "examples" / "tools.yaml")
    assert reg.names() == ["calculator", "python"]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"tool": []}, "top-level 'tools' list"),
        ({"tools": {"a": 1}}, "'tools' must be a list"),
        ({"tools": ["calculator"]}, r"tools\[0\]: must be a mapping"),
        ({"tools": [{"config": {}}]}, r"tools\[0\]\.class_name: required"),
        ({"tools": [{"class_name": "agentloop.tools.builtin.calculator.CalculatorTool"}, {"class_name": "nope.Nope"}]},
         r"tools\[1\]\.class_name: cannot load 'nope.Nope': No module named 'nope'"),
        ({"tools": [{"class_name": "agentloop.tools.builtin.calculator.Missing"}]}, r"tools\[0\]\.class_name: .*has no attribute 'Missing'"),
        ({"tools": [{"class_name": "agentloop.tools.registry.ToolRegistry"}]}, r"tools\[0\]\.class_name: .*is not a tool class: no `execute` method"),
        ({"tools": [{"class_name": "Calculator"}]}, r"tools\[0\]\.class_name: .*not a dotted path"),
        ({"tools": [{"class_name": "agentloop.tools.builtin.calculator.CalculatorTool", "config": {"bogus": 1}}]},
         r"tools\[0\]\.config: CalculatorTool does not accept it: .*bogus"),
        ({"tools": [{"class_name": "agentloop.tools.builtin.calculator.CalculatorTool", "config": [1]}]}, r"tools\[0\]\.config: must be a mapping"),
        ({"tools": [{"class_name": "agentloop.tools.builtin.python.PythonTool", "config": {"timeout": -1}}]},
         r"tools\[0\]\.config: PythonTool\(\.\.\.\) failed: ValueError"),
        ({"tools": [{"class_name": "agentloop.tools.builtin.calculator.CalculatorTool", "tool_schema": {"function": {"parameters": {"type": "objekt"}}}}]},
         r"tools\[0\]: parameters of tool 'calculator' are not a valid JSON schema"),
        ({"tools": [{"class_name": "agentloop.tools.builtin.calculator.CalculatorTool", "tool_schema": {"function": {"name": ""}}}]},
         r"tools\[0\]\.tool_schema\.function\.name: must be a non-empty string"),
        ({"tools": [{"class_name": "agentloop.tools.builtin.calculator.CalculatorTool", "tool_schema": "calc"}]},
         r"tools\[0\]\.tool_schema: must be a mapping"),
        ({"tools": [{"class_name": "agentloop.tools.builtin.calculator.CalculatorTool", "schema": {}}]},
         r"tools\[0\]: unknown field\(s\) \['schema'\]"),
        ({"tools": [{"class_name": "agentloop.tools.builtin.calculator.CalculatorTool"},
                    {"class_name": "agentloop.tools.builtin.calculator.CalculatorTool"}]}, r"tools\[1\]: duplicate tool name 'calculator'"),
    ],
)
def test_config_errors_name_the_entry_and_field(config, message):
    with pytest.raises(ToolConfigError, match=message):
        ToolRegistry.from_config(config)


def test_yaml_file_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("tools:\n  - class_name: [unclosed\n")
    with pytest.raises(ToolConfigError, match="bad.yaml:3:1: not valid YAML"):
        ToolRegistry.from_yaml(p)
    p.write_text("tools:\n  - config: {}\n")
    with pytest.raises(ToolConfigError, match=r"bad.yaml:2: tools\[0\]\.class_name: required"):  # the entry's line
        ToolRegistry.from_yaml(p)
    with pytest.raises(ToolConfigError, match="cannot read tool config"):
        ToolRegistry.from_yaml(tmp_path / "missing.yaml")
    assert ToolRegistry.from_config(None).names() == [] and ToolRegistry.from_config({"tools": None}).names() == []


# A tool config in verl's layout, verbatim as in verl's examples/sglang_multiturn/config/tool_config/
# (quoted strings, `config: {type: native}` read by verl's registry), with agentloop's calculator as
# the class.
VERL_TOOL_CONFIG = '''
tools:
  - class_name: "agentloop.tools.builtin.calculator.CalculatorTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calculator"
        description: "Evaluate an arithmetic expression and return its value."
        parameters:
          type: "object"
          properties:
            expression:
              type: "string"
              description: "The arithmetic expression, e.g. 12 * (3 + 4)"
          required: ["expression"]
  - class_name: "agentloop.tools.builtin.calculator.CalculatorTool"
    config: {type: native, max_exponent: 10}
    tool_schema:
      type: "function"
      function:
        name: "small_calculator"
        description: "A calculator with small exponents."
        parameters:
          type: "object"
          properties:
            expression:
              type: "string"
          required: ["expression"]
'''


async def test_verl_tool_config_with_type_native_loads_and_runs(tmp_path):
    p = tmp_path / "gsm8k_tool_config.yaml"
    p.write_text(VERL_TOOL_CONFIG)
    reg = ToolRegistry.from_yaml(p)
    assert reg.names() == ["calculator", "small_calculator"]
    assert reg.get("small_calculator").limits["max_exponent"] == 10  # the other keys still reach the constructor
    assert reg.schemas(["calculator"])[0]["function"]["parameters"]["required"] == ["expression"]
    res = await reg.execute_calls([ToolCall("calculator", {"expression": "12 * (3 + 4)"}, "")],
                                  context=ctx(), timeout=5, max_parallel=1)
    assert (res[0].ok, res[0].content) == (True, "84")


@pytest.mark.parametrize("kind", ["mcp", "benchmax", "Native", None])
def test_verl_tool_types_other_than_native_are_refused_clearly(kind):
    # An mcp entry in verl also carries an `mcp:` section: the type is reported, not that field.
    entry = {"class_name": "agentloop.tools.builtin.calculator.CalculatorTool", "config": {"type": kind},
             "mcp": {"mcp_servers_config_path": "servers.json"}}
    with pytest.raises(ToolConfigError, match=rf"tools\[0\]\.config\.type: {kind!r} tools are not supported; agentloop runs native tools only"):
        ToolRegistry.from_config({"tools": [entry]})


class DuckCalculator:
    """A tool by shape only: no `Tool` base class, just name, schema and an async execute."""

    name = "duck_calc"
    schema = {
        "type": "function",
        "function": {
            "name": "duck_calc",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]},
        },
    }

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        return str(arguments["a"] + arguments["b"])


async def test_a_duck_typed_tool_registers_validates_and_runs():
    reg = ToolRegistry([DuckCalculator(), CalculatorTool()])
    assert reg.names() == ["duck_calc", "calculator"]
    assert reg.schemas(["duck_calc"]) == [DuckCalculator.schema]
    res = await reg.execute_calls(
        [ToolCall("duck_calc", {"a": 2, "b": 40}, ""), ToolCall("duck_calc", {"a": "2"}, "")],
        context=ctx(), timeout=5, max_parallel=2,
    )
    assert (res[0].ok, res[0].content) == (True, "42")
    assert res[1].error_kind == "bad_arguments" and "'b' is a required property" in res[1].content


def test_a_duck_typed_tool_class_loads_from_yaml_with_a_schema_override(tmp_path):
    p = tmp_path / "tools.yaml"
    p.write_text(textwrap.dedent("""
        tools:
          - class_name: test_tools_registry.DuckCalculator
            tool_schema:
              type: function
              function: {name: add, description: Add a and b.}
    """))
    reg = ToolRegistry.from_yaml(p)
    assert reg.names() == ["add"] and type(reg.get("add")).__name__ == "DuckCalculator"
    fn = reg.schemas()[0]["function"]
    assert (fn["name"], fn["description"], fn["parameters"]["required"]) == ("add", "Add a and b.", ["a", "b"])
    assert DuckCalculator.schema["function"]["name"] == "duck_calc"  # the class's schema is left alone


class SyncExecute:
    name = "sync"
    runs_on_event_loop = True  # a plain execute would block the loop: refused
    schema = {"type": "function", "function": {"name": "sync", "parameters": {"type": "object"}}}

    def execute(self, arguments, context):
        return "not awaitable"


class Mismatch(DuckCalculator):
    name = "other_name"


class NotAFunctionSchema(DuckCalculator):
    schema = {"type": "retrieval"}


@pytest.mark.parametrize(
    "obj, message",
    [
        (object(), r"tools\[0\]: object object is not a tool: `name` \(a non-empty str\); `execute` \(async def execute.*; `schema` \(an OpenAI function schema"),
        (SyncExecute(), r"SyncExecute object is not a tool: `execute` must be async when `runs_on_event_loop` is set"),
        (Mismatch(), r"tool name 'other_name' differs from its schema's function name 'duck_calc'"),
        (NotAFunctionSchema(), r"`schema` must be an OpenAI function schema"),
    ],
)
def test_objects_that_are_not_tools_are_refused_naming_what_is_missing(obj, message):
    with pytest.raises(ToolConfigError, match=message):
        ToolRegistry([obj])


class VerlStyleTool:
    """Per-trajectory state the verl way: `create(instance_id, **create_kwargs)` / `release(instance_id)`,
    state kept by instance id (here the trajectory id) on the shared tool."""

    name = "grader"
    schema = {"type": "function", "function": {"name": "grader", "parameters": {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}

    def __init__(self) -> None:
        self.instances: dict[str, dict[str, Any]] = {}
        self.log: list[tuple[str, str]] = []

    async def create(self, instance_id: str, ground_truth: str | None = None, **kwargs: Any) -> str:
        self.log.append(("create", instance_id))
        self.instances[instance_id] = {"ground_truth": ground_truth, "calls": 0}
        return instance_id

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        inst = self.instances[context.trajectory_id]
        inst["calls"] += 1
        return "correct" if arguments["answer"] == inst["ground_truth"] else "wrong"

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.log.append(("release", instance_id))
        del self.instances[instance_id]


async def test_verl_style_create_and_release_get_the_trajectory_id_and_create_kwargs():
    tool = VerlStyleTool()
    reg = ToolRegistry([tool])
    a = ToolContext("a", extra={"tools_kwargs": {"grader": {"create_kwargs": {"ground_truth": "7"}}}})
    b = ToolContext("b")  # no tools_kwargs: create gets the instance id alone
    async with reg.trajectory(a), reg.trajectory(b):
        assert tool.instances == {"a": {"ground_truth": "7", "calls": 0}, "b": {"ground_truth": None, "calls": 0}}
        ra = await reg.execute_calls([ToolCall("grader", {"answer": "7"}, "")], context=a, timeout=1, max_parallel=1)
        rb = await reg.execute_calls([ToolCall("grader", {"answer": "7"}, "")], context=b, timeout=1, max_parallel=1)
        assert (ra[0].content, rb[0].content) == ("correct", "wrong")
    assert tool.instances == {} and sorted(tool.log) == [("create", "a"), ("create", "b"), ("release", "a"), ("release", "b")]


class BothNamings(StatefulTool):
    """Defines this package's hooks and verl's: `create_state`/`release_state` win, verl's are not called."""

    name = "both"

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        raise AssertionError("create_state is the hook when a tool has both")

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        raise AssertionError("release_state is the hook when a tool has both")


async def test_create_state_wins_over_verl_names_and_a_sync_create_is_not_a_hook():
    tool = BothNamings()
    reg = ToolRegistry([tool])
    async with reg.trajectory(ctx("x")) as c:
        assert c.state == {"both": 0}
    assert tool.released == ["x"]

    class Factory(DuckCalculator):
        @classmethod
        def create(cls) -> "Factory":  # a sync factory named `create` is not verl's hook
            return cls()

    from agentloop.tools import state_hooks

    assert state_hooks(Factory()) == (None, None)
    async with ToolRegistry([Factory()]).trajectory(ctx("y")):  # nothing to create: no call to the factory
        pass
    assert not CalculatorTool().has_state()
    create, release = state_hooks(VerlStyleTool())
    assert create is not None and release is not None
