"""Property tests of `agentloop.chat.TokenBuffer` over three chat templates.

For any sequence of model turns (random ids, ending in the end-of-turn token or not) and tool/user
turns: prompt_ids + response_ids is what the engine saw at its last turn plus what it sampled, every
earlier engine input is a prefix of it, mask-1 positions hold exactly the sampled ids in order with
their logprobs, and — when the sampled turns are well-formed assistant messages — the buffer equals
the chat template's own rendering of the whole conversation (so the deltas are exactly the template's).
"""

from __future__ import annotations

import functools
import string
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentloop.chat import ChatTemplateError, TokenBuffer, render_ids
from agentloop.engine.base import GenerateOutput
from agentloop.types import Trajectory

try:
    from test_chat_templates import TOOLS, llama3_style_tokenizer, qwen_style_tokenizer
except ImportError:  # tests/ imported as a package
    from tests.test_chat_templates import TOOLS, llama3_style_tokenizer, qwen_style_tokenizer


@functools.lru_cache(maxsize=None)
def tiny_tokenizer() -> Any:
    """The shipped tiny tool model's tokenizer (None until that model exists in the package)."""
    try:
        from transformers import AutoTokenizer

        from agentloop.models import tiny_tool_model

        return AutoTokenizer.from_pretrained(str(tiny_tool_model()))
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


TOKENIZERS = {
    "qwen": qwen_style_tokenizer,
    "llama3": llama3_style_tokenizer,
    "tiny": tiny_tokenizer,
}


@pytest.fixture
def get_tok(request: pytest.FixtureRequest) -> Callable[[str], Any]:
    """Tokenizer by name; "random" is the one `make_random_model` ships (plain ChatML, no tools)."""

    def get(name: str) -> Any:
        if name == "random":
            return _load_tokenizer(str(request.getfixturevalue("random_model_dir")))
        tok = TOKENIZERS[name]()
        if tok is None:
            pytest.skip(f"{name} tokenizer not available")
        return tok

    return get


def eot_id(tok: Any) -> int:
    return int(tok.eos_token_id)


_text = st.text(alphabet=string.ascii_letters + string.digits + " .,:+-*/=(){}\"'\n<>_", max_size=40)
_word_text = st.lists(st.text(alphabet=string.ascii_letters + string.digits + "+-*=.", min_size=1, max_size=8), min_size=1, max_size=6).map(" ".join)
_gap = st.one_of(
    st.tuples(st.just("tool"), st.lists(_text, min_size=1, max_size=3)),
    st.tuples(st.just("user"), st.lists(_word_text, min_size=1, max_size=1)),
)


def _gap_messages(gap: tuple[str, list[str]]) -> list[dict[str, Any]]:
    kind, texts = gap
    return [{"role": kind, "content": t} for t in texts]


class RecordingEngine:
    """Plays the engine: records each input, returns the scripted ids with per-token logprobs."""

    def __init__(self) -> None:
        self.inputs: list[list[int]] = []
        self.sampled: list[list[int]] = []
        self.logprobs: list[list[float]] = []

    def __call__(self, input_ids: list[int], ids: list[int], finish: dict[str, Any]) -> GenerateOutput:
        self.inputs.append(list(input_ids))
        k = len(self.inputs)
        lps = [-(0.001 * (k * 100 + i + 1)) for i in range(len(ids))]
        self.sampled.append(list(ids))
        self.logprobs.append(lps)
        return GenerateOutput(
            output_ids=list(ids), output_logprobs=lps, finish_reason=finish, weight_version=f"v{k % 3}",
            rid=f"r{k}", prompt_tokens=len(input_ids), completion_tokens=len(ids),
        )


def _check_buffer(buf: TokenBuffer, eng: RecordingEngine, *, ends_with_model_turn: bool = True) -> Trajectory:
    full = buf.prompt_ids + buf.response_ids
    if ends_with_model_turn:  # what the engine saw at its last turn plus what it sampled
        assert full == eng.inputs[-1] + eng.sampled[-1]
    for inp in eng.inputs:  # every turn extended the same sequence (prefix caching holds)
        assert full[: len(inp)] == inp
    assert eng.inputs[0] == buf.prompt_ids
    sampled = [t for turn in eng.sampled for t in turn]
    lps = [x for turn in eng.logprobs for x in turn]
    assert [t for t, m in zip(buf.response_ids, buf.response_mask) if m == 1] == sampled
    assert [x for x, m in zip(buf.response_logprobs, buf.response_mask) if m == 1] == lps
    assert all(x == 0.0 for x, m in zip(buf.response_logprobs, buf.response_mask) if m == 0)
    assert len(buf.response_ids) == len(buf.response_mask) == len(buf.response_logprobs) == buf.response_len
    traj = buf.to_trajectory("u", "g", status="completed", finish_reason="stop")
    traj.check_invariants()
    assert [t.length for t in traj.turns] == [len(s) for s in eng.sampled]
    for t, s in zip(traj.turns, eng.sampled):
        assert traj.response_ids[t.start : t.start + t.length] == s
    return traj


@pytest.mark.parametrize("name", ["qwen", "llama3", "tiny", "random"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_turns_keep_engine_tokens_verbatim(name: str, get_tok: Callable[[str], Any], data: st.DataObject) -> None:
    tok = get_tok(name)
    vocab = len(tok)
    use_tools = data.draw(st.booleans(), "tools")
    system = data.draw(st.one_of(st.none(), _word_text), "system")
    prompt = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": data.draw(_word_text, "user")}
    ]
    steps = data.draw(
        st.lists(
            st.tuples(st.lists(st.integers(0, vocab - 1), max_size=10), st.booleans(), _gap),
            min_size=1, max_size=5,
        ),
        "steps",
    )
    buf = TokenBuffer(tok, prompt, TOOLS if use_tools else None)
    eng = RecordingEngine()
    for i, (ids, ends_eot, gap) in enumerate(steps):
        ids = ids + [eot_id(tok)] if ends_eot else ids
        finish = {"type": "stop", "matched": eot_id(tok)} if ends_eot else {"type": "length", "length": len(ids)}
        buf.append_model_turn(eng(buf.ids, ids, finish))
        if i < len(steps) - 1:
            buf.append_messages(_gap_messages(gap))
    _check_buffer(buf, eng)


@pytest.mark.parametrize("name", ["qwen", "llama3", "tiny", "random"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_well_formed_turns_reproduce_the_template_rendering(name: str, get_tok: Callable[[str], Any], data: st.DataObject) -> None:
    """If each sampled turn is exactly what the template renders for an assistant message, the
    buffer equals the template's rendering of the whole conversation: the deltas are the template's."""
    tok = get_tok(name)
    use_tools = data.draw(st.booleans(), "tools")
    tools = TOOLS if use_tools else None
    messages: list[dict[str, Any]] = [{"role": "user", "content": data.draw(_word_text, "user")}]
    buf = TokenBuffer(tok, messages, tools)
    eng = RecordingEngine()
    n = data.draw(st.integers(1, 4), "turns")
    for i in range(n):
        content = data.draw(_word_text, f"assistant{i}")
        ends_eot = data.draw(st.booleans(), f"eot{i}")
        ids = tok.encode(content, add_special_tokens=False) + ([eot_id(tok)] if ends_eot else [])
        buf.append_model_turn(eng(buf.ids, ids, {"type": "stop"}))
        messages.append({"role": "assistant", "content": content})
        gap = _gap_messages(data.draw(_gap, f"gap{i}"))
        if name == "llama3" or name == "tiny":  # these templates trim; keep texts trim-stable
            gap = [{**m, "content": m["content"].strip() or "x"} for m in gap]
        buf.append_messages(gap)
        messages.extend(gap)
        assert buf.ids == render_ids(tok, messages, tools=tools, add_generation_prompt=True)
    _check_buffer(buf, eng, ends_with_model_turn=False)


def test_closing_tokens_depend_on_how_the_turn_ended() -> None:
    tok = qwen_style_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    newline = tok.encode("\n", add_special_tokens=False)
    user_block = tok.encode("<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    for sampled, closing in (([5, 6, im_end], newline), ([5, 6], [im_end] + newline)):
        buf = TokenBuffer(tok, [{"role": "user", "content": "hi"}])
        buf.append_model_turn(GenerateOutput(sampled, [-0.1] * len(sampled), {"type": "stop"}, "v1", "r"))
        delta = buf.append_messages([{"role": "user", "content": "ok"}])
        assert delta == closing + user_block
        assert buf.response_mask == [1] * len(sampled) + [0] * len(delta)


def test_budget_remaining_is_the_tighter_limit() -> None:
    tok = qwen_style_tokenizer()
    buf = TokenBuffer(tok, [{"role": "user", "content": "hi"}])
    p = len(buf.prompt_ids)
    assert buf.remaining(100, p + 50) == 50
    assert buf.remaining(30, p + 50) == 30
    buf.append_model_turn(GenerateOutput([1] * 20, [-1.0] * 20, {"type": "length"}, "v", "r"))
    assert buf.response_len == 20
    assert buf.remaining(30, p + 50) == 10
    assert buf.remaining(30, p + 15) == -5


def test_bad_use_is_refused_with_a_clear_error() -> None:
    tok = qwen_style_tokenizer()
    buf = TokenBuffer(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="must follow a model turn"):
        buf.append_messages([{"role": "tool", "content": "1"}])
    with pytest.raises(ValueError, match="logprobs"):
        buf.append_model_turn(GenerateOutput([1, 2], [-1.0], {"type": "stop"}, "v", "r"))
    assert buf.response_ids == []  # nothing half-appended
    with pytest.raises(ValueError, match="prompt"):
        TokenBuffer(tok, [])


def test_template_that_cannot_render_a_role_names_it() -> None:
    tok = qwen_style_tokenizer().__class__(tokenizer_object=qwen_style_tokenizer().backend_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
        "{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    buf = TokenBuffer(tok, [{"role": "user", "content": "hi"}])
    buf.append_model_turn(GenerateOutput([1], [-1.0], {"type": "stop"}, "v", "r"))
    with pytest.raises(ChatTemplateError, match="tool"):
        buf.append_messages([{"role": "tool", "content": "1"}])


def test_resume_continues_an_open_turn_and_keeps_versions() -> None:
    tok = qwen_style_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    buf = TokenBuffer(tok, [{"role": "user", "content": "hi"}])
    buf.append_model_turn(GenerateOutput([7, 8], [-0.5, -0.6], {"type": "stop"}, "v1", "r"))
    buf.append_messages([{"role": "tool", "content": "3"}])
    buf.append_model_turn(GenerateOutput([9], [-0.7], {"type": "abort", "message": "paused"}, "v1", "r"))
    old = buf.to_trajectory("u", "g", status="aborted", finish_reason="abort")

    resumed = TokenBuffer.from_trajectory(old, tok)
    assert resumed.ids == buf.ids and resumed.open_turn_ids == [9]
    resumed.append_model_turn(GenerateOutput([10, im_end], [-0.8, -0.9], {"type": "stop"}, "v2", "r2"))
    assert resumed.open_turn_ids == [9, 10, im_end]  # one assistant message across two weight versions
    resumed.append_messages([{"role": "user", "content": "more"}])
    t = resumed.to_trajectory("u", "g")
    t.check_invariants()
    assert t.weight_versions == ["v1", "v1", "v2"] and t.weight_version == "v2"
    assert [x for x, m in zip(t.response_ids, t.response_mask) if m] == [7, 8, 9, 10, im_end]
    # The earlier tokens are untouched.
    assert t.response_ids[: len(old.response_ids)] == old.response_ids


def test_template_that_rerenders_earlier_turns_still_gives_the_delta() -> None:
    """Qwen3-style: an empty <think> block is rendered only for assistant turns after the last user
    query, so earlier turns change when a user message follows; the delta is what comes after the
    assistant turn's closing, and the sampled turn stays as sampled."""
    base = qwen_style_tokenizer()
    tok = base.__class__(tokenizer_object=base.backend_tokenizer, eos_token="<|im_end|>")
    tok.chat_template = (
        "{%- set ns = namespace(last=-1) %}"
        "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
        "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.role == 'assistant' and loop.index0 > ns.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
        "{{ m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    buf = TokenBuffer(tok, [{"role": "user", "content": "hi"}])
    sampled = tok.encode("<think>\n\n</think>\n\nhello", add_special_tokens=False) + [tok.eos_token_id]
    buf.append_model_turn(GenerateOutput(sampled, [-0.1] * len(sampled), {"type": "stop"}, "v", "r"))
    delta = buf.append_messages([{"role": "user", "content": "again"}])
    assert tok.decode(delta) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert buf.response_ids[: len(sampled)] == sampled
