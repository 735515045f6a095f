"""Tool-call parsers: the Hermes/Qwen format, several calls per turn, malformed calls as errors (never
exceptions), the parser registry, and a hypothesis round trip of arbitrary names and arguments."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop.tools.parsers import (
    HermesToolCallParser,
    Llama3ToolCallParser,
    ToolCall,
    ToolCallParser,
    format_hermes_call,
    format_llama3_calls,
    get_parser,
    register_parser,
    registered_parsers,
)


def call(name, args):
    return format_hermes_call(name, args)


def test_single_call_and_content():
    text = "I will compute it.\n" + call("calculator", {"expression": "12 * 33"})
    content, calls = get_parser("hermes").parse(text)
    assert content == "I will compute it."
    assert calls == [ToolCall("calculator", {"expression": "12 * 33"}, call("calculator", {"expression": "12 * 33"}))]
    assert calls[0].ok


def test_several_calls_in_one_turn_keep_order_and_text_between():
    text = "a " + call("f", {"x": 1}) + " b " + call("g", {}) + "\n" + call("f", {"x": 2}) + " c"
    content, calls = get_parser("qwen").parse(text)
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 1}), ("g", {}), ("f", {"x": 2})]
    assert content == "a  b \n c"
    assert all(c.raw in text for c in calls)


def test_no_calls_returns_text_stripped():
    assert get_parser("hermes").parse("  The answer is 5.\n") == ("The answer is 5.", [])


def test_arguments_as_json_string_and_parameters_alias_and_missing_arguments():
    p = get_parser("hermes")
    _, calls = p.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>')
    assert calls[0].arguments == {"a": [1, 2]} and calls[0].ok
    _, calls = p.parse('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>')
    assert calls[0].arguments == {"a": 1} and calls[0].ok
    _, calls = p.parse('<tool_call>{"name": "f"}</tool_call>')
    assert calls[0].arguments == {} and calls[0].ok


def test_string_argument_may_contain_the_closing_tag():
    args = {"code": "print('</tool_call>')"}
    content, calls = get_parser("hermes").parse("x" + call("python", args) + "y")
    assert calls[0].arguments == args and content == "xy"


@pytest.mark.parametrize(
    "body, fragment",
    [
        ("{bad json}", "invalid JSON"),
        ('{"arguments": {"a": 1}}', 'no "name"'),
        ('{"name": 5, "arguments": {}}', 'no "name"'),
        ('{"name": "  ", "arguments": {}}', 'no "name"'),
        ('{"name": "f", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "f", "arguments": "not json"}', "not valid JSON"),
        ('{"name": "f", "arguments": "[1]"}', "must be a JSON object"),
        ('[{"name": "f"}]', "must be a JSON object"),
        ('{"name": "f", "arguments": {}} trailing', "unexpected text"),
        ("", "invalid JSON"),
    ],
)
def test_malformed_call_is_an_error_not_an_exception(body, fragment):
    text = "before " + "<tool_call>" + body + "</tool_call>" + " after " + call("ok", {"a": 1})
    content, calls = get_parser("hermes").parse(text)
    assert len(calls) == 2, calls
    assert calls[0].error is not None and fragment in calls[0].error, calls[0].error
    assert calls[0].raw == "<tool_call>" + body + "</tool_call>"
    assert calls[1].ok and calls[1].name == "ok"  # a bad call does not spoil the next one
    assert content == "before  after"


def test_unterminated_tag_is_an_error_and_leaves_no_call_text_in_content():
    p = get_parser("hermes")
    content, calls = p.parse('hi <tool_call>\n{"name": "f", "arguments": {"a": 1}}')
    assert content == "hi" and len(calls) == 1
    assert "unterminated" in calls[0].error and calls[0].name == "f"
    content, calls = p.parse('hi <tool_call>\n{"name": "f", "argu')  # cut off by max_new_tokens
    assert content == "hi" and "unterminated" in calls[0].error and calls[0].name is None


def test_registry_aliases_unknown_name_and_plugins():
    assert type(get_parser("qwen")) is type(get_parser("hermes")) is HermesToolCallParser
    assert {"hermes", "qwen"} <= set(registered_parsers())
    with pytest.raises(KeyError, match="unknown tool-call parser 'nope'.*hermes"):
        get_parser("nope")

    @register_parser("test_lines")
    class LineParser(ToolCallParser):
        """CALL name {json} per line."""

        def parse(self, text):
            calls, rest = [], []
            for line in text.splitlines():
                if line.startswith("CALL "):
                    name, _, args = line[5:].partition(" ")
                    calls.append(ToolCall(name, json.loads(args or "{}"), line))
                else:
                    rest.append(line)
            return "\n".join(rest).strip(), calls

    assert get_parser("test_lines").parse('x\nCALL f {"a": 1}')[1][0].arguments == {"a": 1}
    with pytest.raises(TypeError):
        register_parser("bad")(dict)  # type: ignore[arg-type]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=12,
)
names = st.text(min_size=1, max_size=30).filter(lambda s: s.strip() != "")
arguments = st.dictionaries(st.text(max_size=20), json_values, max_size=5)
free_text = st.text(max_size=40).filter(lambda s: "<tool_call>" not in s)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(free_text, names, arguments, st.booleans()), min_size=1, max_size=4), free_text)
def test_round_trip_arbitrary_names_and_arguments(parts, tail):
    text = ""
    for before, name, args, as_string in parts:
        if as_string:  # some models emit the arguments as a JSON string
            block = "<tool_call>\n" + json.dumps({"name": name, "arguments": json.dumps(args)}) + "\n</tool_call>"
        else:
            block = format_hermes_call(name, args)
        text += before + block
    text += tail
    content, calls = get_parser("hermes").parse(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [(n, a, None) for _, n, a, _ in parts]
    assert content == ("".join(b for b, *_ in parts) + tail).strip()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list('<>/{}[]":, ntool_cargumeis\\') + ["<tool_call>", "</tool_call>", '"name"', '"arguments"']), max_size=60).map("".join))
def test_parse_never_raises_on_garbage(text):
    content, calls = get_parser("hermes").parse(text)
    for c in calls:
        assert c.raw.startswith("<tool_call>") and c.raw in text
        if c.error is None:
            assert isinstance(c.name, str) and c.name.strip() and isinstance(c.arguments, dict)
    assert "<tool_call>" not in content


def test_llama3_python_tag_several_calls_and_content():
    text = "Let me check.<|python_tag|>" + '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": "{}"}'
    content, calls = get_parser("llama3").parse(text)
    assert content == "Let me check."
    assert [(c.name, c.arguments, c.error) for c in calls] == [("f", {"x": 1}, None), ("g", {}, None)]
    assert calls[0].raw == '{"name": "f", "parameters": {"x": 1}}'


def test_llama3_whole_message_json_and_plain_text():
    p = get_parser("llama32")
    assert isinstance(p, Llama3ToolCallParser)
    content, calls = p.parse(' {"name": "calculator", "parameters": {"expression": "1 + 2"}}')
    assert content == "" and calls[0].name == "calculator" and calls[0].arguments == {"expression": "1 + 2"}
    assert p.parse("The answer is 3.") == ("The answer is 3.", [])
    assert p.parse('{"answer": 3}') == ('{"answer": 3}', [])  # JSON, but not a call
    assert p.parse("{not json") == ("{not json", [])


def test_llama3_malformed_calls_are_errors():
    content, calls = get_parser("llama3").parse('ok<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "param')
    assert content == "ok" and calls[0].ok and "invalid JSON" in calls[1].error
    _, calls = get_parser("llama3").parse('<|python_tag|>{"parameters": {}}')
    assert 'no "name"' in calls[0].error


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(names, arguments), min_size=1, max_size=4), free_text.filter(lambda s: "<|python_tag|>" not in s))
def test_llama3_round_trip(calls, before):
    content, parsed = get_parser("llama3").parse(before + format_llama3_calls(calls))
    assert [(c.name, c.arguments, c.error) for c in parsed] == [(n, a, None) for n, a in calls]
    assert content == before.strip()
