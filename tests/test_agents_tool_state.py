"""Per-trajectory tool state through the `tool` agent loop, for both hook namings: this package's
`create_state(context)`/`release_state(context)` and verl's `create(instance_id, **kwargs)`/
`release(instance_id, **kwargs)`. Each is created once before the trajectory's first call and released
once when it ends — completed, or failed by an engine error mid-trajectory — with concurrent
trajectories kept apart by the trajectory id.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from agentloop.agents import get_agent
from agentloop.engine.base import EngineError, GenerateOutput, SamplingParams
from agentloop.tools import Tool, ToolContext, ToolRegistry
from agentloop.types import Sample

try:
    from test_agents import ScriptedEngine, call, make_ctx
    from test_chat_templates import qwen_style_tokenizer
except ImportError:  # tests/ imported as a package
    from tests.test_agents import ScriptedEngine, call, make_ctx
    from tests.test_chat_templates import qwen_style_tokenizer

COUNTER_SCHEMA = {"type": "object", "properties": {}}


class ContextStateCounter(Tool):
    """This package's naming: state in `context.state`."""

    name = "counter"
    parameters = COUNTER_SCHEMA

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    async def create_state(self, context: ToolContext) -> None:
        self.log.append(("create", context.trajectory_id))
        context.state[self.name] = 0

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        self.log.append(("execute", context.trajectory_id))
        context.state[self.name] += 1
        return str(context.state[self.name])

    async def release_state(self, context: ToolContext) -> None:
        self.log.append(("release", context.trajectory_id))


class VerlCounter:
    """verl's naming, and no `Tool` base class: state on the shared tool, keyed by instance id."""

    name = "counter"
    schema = {"type": "function", "function": {"name": "counter", "description": "Count.", "parameters": COUNTER_SCHEMA}}

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.counts: dict[str, int] = {}

    async def create(self, instance_id: str, **kwargs: Any) -> str:
        self.log.append(("create", instance_id))
        self.counts[instance_id] = int(kwargs.get("start", 0))
        return instance_id

    async def execute(self, arguments: dict[str, Any], context: ToolContext) -> str:
        self.log.append(("execute", context.trajectory_id))
        self.counts[context.trajectory_id] += 1
        return str(self.counts[context.trajectory_id])

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.log.append(("release", instance_id))
        del self.counts[instance_id]


class VerlCounterTool(VerlCounter, Tool):
    """verl's naming on a `Tool` subclass (the base class's no-op create_state/release_state stay unused)."""


def events_of(log: list[tuple[str, str]], uid: str) -> list[str]:
    return [kind for kind, who in log if who == uid]


@pytest.mark.parametrize("make_tool", [ContextStateCounter, VerlCounter, VerlCounterTool],
                         ids=["create_state", "verl_create", "verl_create_on_Tool"])
async def test_state_is_created_before_the_first_call_and_released_once_at_the_end(make_tool: Any) -> None:
    tok = qwen_style_tokenizer()
    tool = make_tool()  # one tool for every trajectory, as built once per worker
    reg = ToolRegistry([tool])
    trajs = {}

    async def run(uid: str) -> None:
        eng = ScriptedEngine(tok, [call("counter"), call("counter") + call("counter"), "Counted 3."])
        s = Sample(uid=uid, messages=[{"role": "user", "content": "Count to three."}])
        trajs[uid] = await get_agent("tool").run(s, make_ctx(eng, reg))

    async with anyio.create_task_group() as tg:  # two trajectories at once share the tool
        tg.start_soon(run, "t1")
        tg.start_soon(run, "t2")
    for uid in ("t1", "t2"):
        assert trajs[uid].status == "completed", trajs[uid].error
        assert events_of(tool.log, uid) == ["create", "execute", "execute", "execute", "release"]
        # The counts are per trajectory: the other trajectory's calls did not leak in.
        # (The second turn's two calls run concurrently, each in its own thread: either may count first.)
        counts = [m["content"] for m in trajs[uid].messages if m["role"] == "tool"]
        assert counts[0] == "1" and sorted(counts[1:]) == ["2", "3"], counts


@pytest.mark.parametrize("make_tool", [ContextStateCounter, VerlCounter, VerlCounterTool],
                         ids=["create_state", "verl_create", "verl_create_on_Tool"])
async def test_state_is_released_when_the_trajectory_fails(make_tool: Any) -> None:
    tok = qwen_style_tokenizer()

    def broken(ids: list[int], p: SamplingParams) -> GenerateOutput:
        raise EngineError("/generate", 500, "engine died", url="http://x")

    tool = make_tool()
    eng = ScriptedEngine(tok, [call("counter"), broken])
    traj = await get_agent("tool").run(Sample(uid="f1", messages=[{"role": "user", "content": "Count."}]),
                                       make_ctx(eng, ToolRegistry([tool])))
    assert traj.status == "failed" and "engine died" in (traj.error or "")
    assert events_of(tool.log, "f1") == ["create", "execute", "release"]


async def test_verl_create_gets_the_samples_create_kwargs() -> None:
    tok = qwen_style_tokenizer()
    tool = VerlCounter()
    eng = ScriptedEngine(tok, [call("counter"), "Done."])
    s = Sample(uid="k1", messages=[{"role": "user", "content": "Count."}],
               extra={"tools_kwargs": {"counter": {"create_kwargs": {"start": 41}}}})
    traj = await get_agent("tool").run(s, make_ctx(eng, ToolRegistry([tool])))
    assert traj.status == "completed" and traj.messages[2]["content"] == "42"
    assert events_of(tool.log, "k1") == ["create", "execute", "release"]
