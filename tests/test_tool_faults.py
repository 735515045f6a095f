"""Issue 15: one bad tool or tool result never stalls or ends a step.

Each hostile tool below stands in for the `calculator` (same name and schema, so the shipped tiny
model really calls it) in a `Runtime` over the real CPU engine, for two steps: a tool that ignores
cancellation, raises SystemExit / KeyboardInterrupt / CancelledError, blocks the thread with
`time.sleep` (async or plain `def`), returns 10 MB, streams without end, or returns an object whose
`__str__` fails. Every step ends, every trajectory comes back (none failed), and each call that
misbehaved is answered with a tool-error turn naming what happened. The registry-level tests pin the
details (the event loop keeps running while a tool blocks, output bounded while produced, settings).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import json
import time
from pathlib import Path
from typing import Any, Callable

import anyio
import pytest

from agentloop.dataset import load_dataset
from agentloop.data import arithmetic_prompts
from agentloop.engine.sglang import SGLangClient
from agentloop.runtime import Runtime
from agentloop.tools import ToolCall, ToolContext, ToolRegistry
from agentloop.tools.builtin import CalculatorTool

pytestmark = pytest.mark.anyio

try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _LIBC.malloc_trim  # glibc only
except (OSError, AttributeError):
    _LIBC = None

BLOCK_S = 30.0  # how long a hostile tool holds its thread: far longer than any step here may take


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _rss_mb() -> float:
    """Resident memory still in use: freed memory is handed back first (a collection, then glibc's
    malloc_trim), else what the allocator keeps cached decides the figure: after test_tiny_model in the
    same worker the same case read 156 MB here against 18 MB alone, and 312 MB in a full CI run."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Shielded(CalculatorTool):
    """Ignores cancellation."""

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(BLOCK_S)
        return "late"


class Raises(CalculatorTool):
    def __init__(self, exc: Callable[[], BaseException]) -> None:
        self.exc = exc

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        raise self.exc()


class SleepsInAsync(CalculatorTool):
    """A blocking call inside `async def`: would freeze the event loop."""

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        time.sleep(BLOCK_S)
        return "late"


class SleepsInSync(CalculatorTool):
    """A plain `def execute` (a synchronous tool)."""

    def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:  # type: ignore[override]
        time.sleep(BLOCK_S)
        return "late"


class TenMegabytes(CalculatorTool):
    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        return "0123456789" * 1_000_000


class Endless(CalculatorTool):
    """Streams 1 MB pieces for ever."""

    async def execute(self, arguments: dict[str, Any], context: ToolContext):  # type: ignore[override]
        async def pieces():
            while True:
                yield "y" * (1 << 20)
                await anyio.sleep(0)
        return pieces()


class BadStr:
    def __str__(self) -> str:
        raise ValueError("no text for you")


class BadStrResult(CalculatorTool):
    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> Any:
        return BadStr()


# name → (tool factory, what the tool message says, error_kind)
CASES: dict[str, tuple[Callable[[], Any], str, str | None]] = {
    "ignores_cancellation": (Shielded, "Error: tool 'calculator' timed out after 1 seconds", "timeout"),
    "system_exit": (lambda: Raises(lambda: SystemExit(3)), "Error: SystemExit: 3", "exception"),
    "keyboard_interrupt": (lambda: Raises(KeyboardInterrupt), "Error: KeyboardInterrupt", "exception"),
    "cancelled_error": (lambda: Raises(asyncio.CancelledError), "Error: CancelledError", "exception"),
    "time_sleep_in_async": (SleepsInAsync, "Error: tool 'calculator' timed out after 1 seconds", "timeout"),
    "time_sleep_in_sync_tool": (SleepsInSync, "Error: tool 'calculator' timed out after 1 seconds", "timeout"),
    "ten_megabytes": (TenMegabytes, "0123456789", None),
    "endless_stream": (Endless, "Error: tool 'calculator' timed out after 1 seconds; its output so", "timeout"),
    "failing_str": (BadStrResult, "Error: tool 'calculator' returned a BadStr whose str() raised ValueError: no text for you",
                    "exception"),
}


@pytest.fixture(scope="module")
def tiny_engine(start_local_engine: Callable[..., str]) -> tuple[str, str]:
    from agentloop.models import tiny_tool_model

    model = tiny_tool_model()
    return start_local_engine(model), str(model)


@pytest.mark.parametrize("case", list(CASES))
async def test_a_hostile_tool_never_stalls_or_ends_the_step(case: str, tiny_engine: tuple[str, str]) -> None:
    make, says, kind = CASES[case]
    url, model = tiny_engine
    rows = load_dataset(arithmetic_prompts()).samples[:4]
    cfg = {
        "engine": {"urls": [url], "tokenizer": model},
        "scheduler": {"n": 1, "trajectory_timeout": 20.0, "abort_grace": 5.0},
        "agent": {"sampling": {"temperature": 0.0}, "tool_timeout": 1.0, "max_assistant_turns": 2, "max_new_tokens_per_turn": 48,
                  "max_response_tokens": 512, "max_tool_response_tokens": 96},
    }
    async with Runtime(cfg, clients=[SGLangClient(url)], tools=ToolRegistry([make()])) as rt:
        # measured once the runtime is up: its start loads transformers and the tokenizer (hundreds of MB
        # on whichever case runs first in a worker), which is not what the tool's output costs
        rss0 = _rss_mb()
        for _ in range(2):
            with anyio.fail_after(BLOCK_S / 2):  # hang guard: the tool holds its thread for BLOCK_S
                res = await rt.step(rows)
            assert len(res.trajectories) == 4
            assert {t.status for t in res.trajectories} <= {"completed", "truncated"}, \
                [(t.status, t.error) for t in res.trajectories]
            answered = [m for t in res.trajectories for m in t.messages if m["role"] == "tool"]
            calls = sum(t.tool_calls for t in res.trajectories)
            assert calls >= 2 and len(answered) == calls  # every call gets its tool turn
            assert all(says in m["content"] for m in answered), answered[0]["content"][:300]
            kinds = {k for t in res.trajectories for r in t.extra.get("tool_results", []) for k in r["error_kinds"]}
            assert kinds == {kind}
            if case in ("ten_megabytes", "endless_stream"):
                assert all(len(m["content"]) < 4096 for m in answered)
                # nothing of the output beyond the bound is kept anywhere in what the step returns
                kept = sum(len(json.dumps([t.messages, t.extra], default=str)) for t in res.trajectories)
                assert kept < 1_000_000, kept
    # A gross guard only (an endless stream kept whole would be gigabytes): under a loaded CI worker the
    # allocator's high-water mark after 2 x ~5 ten-megabyte strings read 308 MB with nothing retained.
    assert _rss_mb() - rss0 < 600


# ------------------------------------------------------------------------------- registry level
def _ctx() -> ToolContext:
    return ToolContext(trajectory_id="t")


def _call(name: str = "calculator") -> ToolCall:
    return ToolCall(name, {"expression": "1 + 1"}, "")


async def test_the_event_loop_keeps_running_while_a_tool_blocks_its_thread() -> None:
    seen_while_blocked: list[bool] = []
    state = {"in_sleep": False}

    class Blocks(CalculatorTool):
        async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
            state["in_sleep"] = True
            time.sleep(3)
            state["in_sleep"] = False
            return "late"

    async def ticker() -> None:
        while True:
            seen_while_blocked.append(state["in_sleep"])
            await anyio.sleep(0.02)

    reg = ToolRegistry([Blocks()])
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        res = await reg.execute_calls([_call()], context=_ctx(), timeout=0.5, max_parallel=1)
        tg.cancel_scope.cancel()
    assert res[0].error_kind == "timeout" and not res[0].ok
    assert any(seen_while_blocked), "the loop did not run while the tool slept"


async def test_a_calls_result_is_refused_after_its_timeout_even_if_it_returns_later() -> None:
    class Slow(CalculatorTool):
        def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:  # type: ignore[override]
            time.sleep(1.5)
            return "accepted?"

    res = await ToolRegistry([Slow()]).execute_calls([_call()], context=_ctx(), timeout=0.3, max_parallel=1)
    assert res[0].content == "Error: tool 'calculator' timed out after 0.3 seconds"


async def test_a_sync_tool_returns_normally_from_its_thread() -> None:
    class Sync(CalculatorTool):
        def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:  # type: ignore[override]
            return f"sync {arguments['expression']}"

    res = await ToolRegistry([Sync()]).execute_calls([_call()], context=_ctx(), timeout=5, max_parallel=1)
    assert (res[0].ok, res[0].content) == (True, "sync 1 + 1")


class CountingStream(CalculatorTool):
    """A plain `def execute` returning an endless generator of `piece`; counts the pieces produced."""

    def __init__(self, piece: str) -> None:
        self.piece, self.produced = piece, 0

    def execute(self, arguments: dict[str, Any], context: ToolContext):  # type: ignore[override]
        def gen():
            while True:
                self.produced += 1
                yield self.piece
        return gen()


async def test_output_is_bounded_while_produced_with_the_configured_limit_and_marker() -> None:
    stream = CountingStream("abcdefghij" * 100)  # 1000 bytes a piece
    reg = ToolRegistry([stream])
    res = await reg.execute_calls([_call()], context=_ctx(), timeout=5, max_parallel=1, truncate_side="right",
                                  max_result_bytes=2500, truncation_marker="[cut {n} {unit}]")
    # Head kept: the stream was read only until the limit was reached, then closed (not until timeout).
    assert res[0].ok and res[0].truncated
    assert res[0].content == ("abcdefghij" * 250) + "[cut 500+ bytes]"
    assert stream.produced == 3

    class Big(CalculatorTool):
        async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
            return "é" * 1000 + "x" * 5_000_000 + "END"

    res = await ToolRegistry([Big()]).execute_calls([_call()], context=_ctx(), timeout=5, max_parallel=1,
                                                   max_result_bytes=1000, truncation_marker="<<{n} {unit} dropped>>")
    text = res[0].content
    assert res[0].truncated and text.startswith("é" * 250) and text.endswith("x" * 497 + "END")
    marker = f"<<{2000 + 5_000_000 + 3 - 1000} bytes dropped>>"  # all but the 1000 bytes kept
    assert marker in text and len(text.encode()) == 1000 + len(marker)


async def test_the_marker_setting_reaches_token_truncation_and_is_validated() -> None:
    from agentloop.config import RuntimeConfig

    cfg = RuntimeConfig.model_validate({"agent": {"max_tool_response_bytes": 64, "tool_response_truncation_marker": "[{n} {unit} cut]"}})
    ac = cfg.agent
    assert (ac.max_tool_response_bytes, ac.tool_response_truncation_marker) == (64, "[{n} {unit} cut]")
    with pytest.raises(ValueError, match="not a valid template"):
        RuntimeConfig.model_validate({"agent": {"tool_response_truncation_marker": "{count}"}})

    class Words:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [len(w) for w in text.split(" ")]

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return " ".join("w" * i for i in ids)

    class Long(CalculatorTool):
        async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
            return " ".join(["www"] * 50)

    res = await ToolRegistry([Long()]).execute_calls([_call()], context=_ctx(), timeout=5, max_parallel=1, tokenizer=Words(),
                                                    max_result_tokens=10, truncate_side="right", truncation_marker="[{n} {unit} cut]")
    assert res[0].truncated and "tokens cut]" in res[0].content


async def test_state_hooks_raising_system_exit_fail_the_trajectory_not_the_process() -> None:
    class BadCreate(CalculatorTool):
        async def create_state(self, context: ToolContext) -> None:
            raise SystemExit(4)

    with pytest.raises(RuntimeError, match="create_state failed .*: 4"):
        await ToolRegistry([BadCreate()]).open_trajectory(_ctx())


# ------------------------------------------------------------------------------- pathological calls
@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_parsers_refuse_a_call_nested_3000_levels_deep_and_an_oversized_call(parser: str) -> None:
    from agentloop.tools import get_parser
    from agentloop.tools.parsers import MAX_CALL_CHARS, MAX_CALL_DEPTH

    deep = '{"name": "calculator", "arguments": {"expression": ' + "[" * 3000 + "]" * 3000 + "}}"
    huge = '{"name": "calculator", "arguments": {"expression": "' + "1" * (MAX_CALL_CHARS + 10) + '"}}'
    nested_string = '{"name": "calculator", "arguments": "{\\"e\\": ' + "[" * 3000 + "]" * 3000 + '}"}'
    wrap = (lambda j: f"<tool_call>\n{j}\n</tool_call>") if parser == "hermes" else (lambda j: "<|python_tag|>" + j)
    p = get_parser(parser)
    for body, says in ((deep, f"nested too deeply (more than {MAX_CALL_DEPTH} levels)"),
                       (huge, f"more than the limit of {MAX_CALL_CHARS}"),
                       (nested_string, "nested too deeply")):
        _, calls = p.parse(wrap(body))
        assert len(calls) == 1 and not calls[0].ok and says in calls[0].error, calls[0].error
    ok = '{"name": "calculator", "arguments": {"e": ' + "[" * 40 + "]" * 40 + "}}"
    assert p.parse(wrap(ok))[1][0].ok  # deep but sane nesting still parses


async def test_a_trajectory_with_a_3000_deep_call_gets_a_clear_error_turn_and_goes_on() -> None:
    try:
        from test_agents import ScriptedEngine, make_ctx
        from test_chat_templates import qwen_style_tokenizer
    except ImportError:  # tests/ imported as a package
        from tests.test_agents import ScriptedEngine, make_ctx
        from tests.test_chat_templates import qwen_style_tokenizer
    from agentloop.agents import get_agent
    from agentloop.types import Sample

    deep = '<tool_call>\n{"name": "calculator", "arguments": {"expression": ' + "[" * 3000 + "]" * 3000 + "}}\n</tool_call>"
    eng = ScriptedEngine(qwen_style_tokenizer(), [deep, "The answer is 2."])
    s = Sample(uid="deep", messages=[{"role": "user", "content": "What is 1 + 1?"}])
    traj = await get_agent("tool").run(s, make_ctx(eng, ToolRegistry([CalculatorTool()]), max_response_tokens=100_000,
                                                   max_context_tokens=100_000, max_new_tokens_per_turn=100_000))
    assert traj.status == "completed", traj.error
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_msgs == ["Error: could not parse tool call: tool call JSON is nested too deeply (more than 64 levels)"]


async def test_an_abandoned_endless_sync_stream_stops_producing() -> None:
    """A plain generator cannot be cancelled inside its thread: the closed sink stops it at its next
    piece, so an endless stream does not burn a CPU (and the GIL) for ever after its timeout."""
    endless = CountingStream("z" * 1000)
    res = await ToolRegistry([endless]).execute_calls([_call()], context=_ctx(), timeout=0.3, max_parallel=1)
    assert res[0].error_kind == "timeout" and "its output so far" in res[0].content
    # The sink was closed when the call was abandoned, so the generator stopped at its next piece
    # (within the cancel grace that execute_calls waited): nothing more is produced afterwards.
    seen = endless.produced
    await anyio.sleep(0.3)
    assert endless.produced <= seen + 1  # (one piece in flight if a loaded machine outlasted the grace)


async def test_runtime_refuses_a_bad_tools_file_before_starting_an_engine(tmp_path: Path) -> None:
    from agentloop.tools import ToolConfigError

    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: agentloop.tools.builtin.calculator.CalculatorTool\n    config: {}\n    config: {}\n")
    rt = Runtime({"agent": {"tools": str(tools)}})  # no URLs: start() would launch the embedded engine
    with pytest.raises(ToolConfigError, match=r"tools.yaml:4:5: not valid YAML: duplicated key 'config'"):
        await rt.start()
    assert rt.processes == [] and rt.clients == []
