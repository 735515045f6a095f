"""The readable `messages` of a `tool`-loop trajectory are OpenAI chat format: every tool call has a
stable id (`call_<uid>_<turn>_<i>`), `function.arguments` is a JSON string, and each tool message
carries the `tool_call_id` of its call. The tokens are not affected: the tool results' token deltas
are rendered exactly as before ids existed — pinned by hashes of whole scripted trajectories recorded
before the change, for the shipped tiny model's template, a Qwen-style, a Llama-3-style and a
template that would print a `tool_call_id` if it were given one.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from agentloop.agents import get_agent
from agentloop.tools import ToolRegistry
from agentloop.tools.parsers import format_llama3_calls
from agentloop.types import Sample, Trajectory

try:
    from test_agents import Calculator, ScriptedEngine, call, make_ctx
    from test_chat_templates import _bpe, llama3_style_tokenizer, qwen_style_tokenizer
except ImportError:  # tests/ imported as a package
    from tests.test_agents import Calculator, ScriptedEngine, call, make_ctx
    from tests.test_chat_templates import _bpe, llama3_style_tokenizer, qwen_style_tokenizer

# Prints the tool message's tool_call_id when the message has one (as e.g. Mistral's templates do).
ID_PRINTING_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}"
    "{%- if message.role == 'tool' and message.tool_call_id is defined %} id={{ message.tool_call_id }}{%- endif %}\n"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.lru_cache(maxsize=None)
def id_printing_tokenizer() -> PreTrainedTokenizerFast:
    t = PreTrainedTokenizerFast(tokenizer_object=_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
                                eos_token="<|im_end|>", pad_token="<|endoftext|>")
    t.chat_template = ID_PRINTING_TEMPLATE
    return t


@functools.lru_cache(maxsize=None)
def tiny_model_tokenizer() -> Any:
    from agentloop.models import tiny_tool_model

    return AutoTokenizer.from_pretrained(str(tiny_tool_model()))


def _calls(parser: str, *exprs: str) -> str:
    if parser == "llama3":
        return format_llama3_calls([("calculator", {"expression": e}) for e in exprs])
    return "\n".join(call("calculator", expression=e) for e in exprs)


async def _run(tokenizer: Any, parser: str) -> Trajectory:
    """Two parallel calls, then a malformed call, then the answer."""
    bad = "<|python_tag|>{oops" if parser == "llama3" else "<tool_call>\n{oops}\n</tool_call>"
    eng = ScriptedEngine(tokenizer, [_calls(parser, "12 * 3", "3 + 1"), bad, "The answer is 40."])
    s = Sample(uid="m0", messages=[{"role": "user", "content": "What is 12 * 3 + 4?"}])
    return await get_agent("tool").run(s, make_ctx(eng, ToolRegistry([Calculator()]), tool_parser=parser))


def _digest(traj: Trajectory) -> str:
    blob = json.dumps([traj.prompt_ids, traj.response_ids, traj.response_mask], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# (tokenizer, parser) -> sha256[:16] of [prompt_ids, response_ids, response_mask], recorded with the
# loop as it was before call ids and tool_call_id existed (commit acb1114).
GOLDEN = {
    "tiny_model": ("hermes", "e4f3b0c364ab34e3"),
    "qwen_style": ("hermes", "c47cfaea6c934e54"),
    "llama3_style": ("llama3", "63737a300b5b6d24"),
    "id_printing": ("hermes", "ba30cdee0530d6df"),
}
TOKENIZERS = {
    "tiny_model": tiny_model_tokenizer,
    "qwen_style": qwen_style_tokenizer,
    "llama3_style": llama3_style_tokenizer,
    "id_printing": id_printing_tokenizer,
}


@pytest.mark.parametrize("name", list(GOLDEN))
async def test_token_ids_are_what_they_were_before_call_ids(name: str) -> None:
    parser, digest = GOLDEN[name]
    traj = await _run(TOKENIZERS[name](), parser)
    assert traj.status == "completed" and traj.tool_calls == 3, (traj.status, traj.error)
    traj.check_invariants()
    assert _digest(traj) == digest


@pytest.mark.parametrize("name", ["qwen_style", "llama3_style"])
async def test_messages_are_openai_format_with_ids_json_arguments_and_tool_call_ids(name: str) -> None:
    parser = GOLDEN[name][0]
    traj = await _run(TOKENIZERS[name](), parser)
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "tool", "assistant", "tool", "assistant"]
    first, second = traj.messages[1], traj.messages[4]
    assert [c["id"] for c in first["tool_calls"]] == ["call_m0_1_0", "call_m0_1_1"]
    assert [c["id"] for c in second["tool_calls"]] == ["call_m0_2_0"]
    for c, expr in zip(first["tool_calls"], ["12 * 3", "3 + 1"]):
        assert c["type"] == "function" and c["function"]["name"] == "calculator"
        assert isinstance(c["function"]["arguments"], str)  # OpenAI: a JSON string
        assert json.loads(c["function"]["arguments"]) == {"expression": expr}
    # A malformed call keeps the text the model wrote, still a string.
    assert second["tool_calls"][0]["function"]["name"] is None and "oops" in second["tool_calls"][0]["function"]["arguments"]
    tools = [m for m in traj.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == ["call_m0_1_0", "call_m0_1_1", "call_m0_2_0"]
    assert [m["content"] for m in tools[:2]] == ["36", "4"] and tools[2]["content"].startswith("Error")
    # Every id is unique within the trajectory and every tool message answers an earlier call.
    ids = [c["id"] for m in traj.messages for c in m.get("tool_calls") or []]
    assert len(set(ids)) == len(ids) and {m["tool_call_id"] for m in tools} == set(ids)
