"""The `tool` agent loop: generate → parse tool calls → run tools → append results → repeat.

Ends when a turn has no tool call (then the optional simulated user may add a user turn and the loop
goes on: the sample's `extra["interaction"]`, a registered name or `module:function` path, else
`ctx.interaction`; the `interaction` loop, a subclass, requires one), when `max_assistant_turns` /
`max_user_turns` is reached, or when the token budget is spent. Statuses: completed (the model stopped), truncated (a limit or the budget cut
it), aborted (the engine aborted a turn, or a stop of the trajectory cut its tool calls, which end at
once — partial rollout resumes it from `sample.resume_from`, running the cut calls again),
failed (an unexpected exception; returned, never raised). Malformed calls, unknown tools, timeouts
and exceptions inside tools reach the model as tool results (the registry makes them), counted in
`metrics["tool_errors"]`.

The trajectory's readable `messages` are OpenAI chat format: each call gets the id
`call_<uid>_<turn>_<i>`, its `function.arguments` is a JSON string, and its tool message carries the
matching `tool_call_id`. The tokens do not depend on that: a tool result's token delta is rendered
from the message without `tool_call_id` (as before ids existed), so no template's rendering changes;
model turns are never rendered at all (their tokens are the sampled ones).
"""

from __future__ import annotations

import json
import math
from typing import Any

import anyio

from ..tools import ToolCall, ToolContext, ToolResult, get_parser
from ..types import Sample, Trajectory
from .base import AgentContext, AgentLoop
from .registry import register_agent
from .episode import BudgetSpent, Episode
from .interaction import Interaction, ask_user, get_interaction

#: `Trajectory.extra` key: a stop cut this trajectory's tool calls (its resume runs them again).
INTERRUPTED_TOOLS = "tool_calls_interrupted"


@register_agent
class ToolAgent(AgentLoop):
    name = "tool"

    def simulated_user(self, sample: Sample, ctx: AgentContext) -> Interaction | None:
        """The simulated user asked after a turn without tool calls (None: such a turn completes the
        trajectory): the one the sample names in `extra["interaction"]` — the more specific choice, as
        a sample's `agent` wins over the default loop — else the context's (runtime-wide) hook.
        Raises ValueError for a name or path that does not resolve."""
        spec = sample.extra.get("interaction")
        if spec is None:
            return ctx.interaction
        try:
            return get_interaction(spec)
        except (KeyError, ImportError, TypeError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            raise ValueError(f"sample {sample.uid}: extra['interaction']: {msg}") from e

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        tools = sample.tools if sample.tools is not None else (ctx.tools.schemas() if ctx.tools is not None else None)
        try:
            ep = Episode.start(sample, ctx, tools=tools)
        except Exception as e:  # bad prompt or template: this sample fails, the step goes on
            return Episode.failed_before_start(sample, ctx, e)
        tool_ctx = ToolContext(trajectory_id=sample.uid, extra={"ground_truth": sample.ground_truth, **sample.extra})
        try:
            user = self.simulated_user(sample, ctx)
            if ctx.tools is not None:
                async with ctx.tools.trajectory(tool_ctx):
                    await self._loop(ep, tool_ctx, user)
            else:
                await self._loop(ep, tool_ctx, user)
        except BudgetSpent as b:
            ep.finish("truncated", b.reason)
        except Exception as e:
            ep.fail(e)
        return ep.trajectory()

    async def _loop(self, ep: Episode, tool_ctx: ToolContext, user: Interaction | None) -> None:
        cfg = ep.config
        parser = get_parser(cfg.tool_parser)
        assert ep.buffer is not None
        # A trajectory whose tool calls a stop cut resumes by running them again (its assistant
        # message is already shown; the calls are parsed again from the same tokens, with the same ids).
        interrupted = bool(ep.extra.pop(INTERRUPTED_TOOLS, False))
        while True:
            if interrupted:
                interrupted = False
                out = None
                content, calls = parser.parse(ep.turn_text())
            else:
                out = await ep.generate()
                if out.aborted:  # keep the partial text readable; a resume continues (and replaces) it
                    ep.show_assistant({"role": "assistant", "content": ep.turn_text()})
                    ep.finish("aborted", "abort")
                    return
                content, calls = parser.parse(ep.turn_text())
            for i, c in enumerate(calls):  # stable per trajectory, turn and position (a resumed turn keeps its number)
                c.id = c.id or f"call_{ep.sample.uid}_{ep.assistant_turns}_{i}"
            if out is not None:
                ep.show_assistant(assistant_message(content, calls))
            if calls:
                if ep.assistant_turns >= cfg.max_assistant_turns:
                    ep.finish("truncated", "max_assistant_turns")
                    return
                with ep.ctx.interruptible() as wait:  # a stop (early stop, sleep) ends the calls at once
                    results = await self._run_tools(ep, calls, tool_ctx)
                if wait.cancelled_caught:
                    ep.extra[INTERRUPTED_TOOLS] = True
                    ep.finish("aborted", "abort")
                    return
                shown = [_tool_message(r) for r in results]
                # Rendered without tool_call_id: the tokens stay what they were before calls had ids
                # (some templates, e.g. Mistral's, would print it; the model never sampled these ids).
                rendered = [{k: v for k, v in m.items() if k != "tool_call_id"} for m in shown]
                ep.append_messages(rendered, shown=shown)
                continue
            if out is not None and out.finish_type == "length":
                ep.finish("truncated", ep.extra.get("turn_cut_by", "length"))
                return
            if user is None:
                ep.finish("completed", "stop")
                return
            if ep.user_turns >= cfg.max_user_turns:
                ep.finish("truncated", "max_user_turns")
                return
            if ep.assistant_turns >= cfg.max_assistant_turns:
                ep.finish("truncated", "max_assistant_turns")
                return
            t0 = ep.clock()
            reply = await ask_user(
                user, ep.buffer.messages, ep.sample,
                timeout=cfg.interaction_timeout,
            )
            ep.event("user", t0, ep.clock())
            if reply is None:
                ep.finish("completed", "stop")
                return
            ep.user_turns += 1
            ep.append_messages([reply])

    async def _run_tools(self, ep: Episode, calls: list[ToolCall], tool_ctx: ToolContext) -> list[ToolResult]:
        cfg = ep.config
        t0 = ep.clock()
        if ep.ctx.tools is None:
            results = [
                ToolResult(i, c.name, "Error: no tools are available in this conversation", ok=False,
                           error_kind="unknown_tool", call_id=c.id)
                for i, c in enumerate(calls)
            ]
        else:
            # The registry abandons each call at its timeout whatever the tool does (see
            # tools.call_thread); this outer bound (all waves plus slack) is the last line.
            waves = math.ceil(len(calls) / max(1, cfg.max_parallel_calls))
            with anyio.fail_after(cfg.tool_timeout * waves + 5.0):
                results = await ep.ctx.tools.execute_calls(
                    calls, context=tool_ctx, timeout=cfg.tool_timeout, max_parallel=cfg.max_parallel_calls,
                    tokenizer=ep.ctx.tokenizer, max_result_tokens=cfg.max_tool_response_tokens,
                    truncate_side=cfg.tool_response_truncate_side,  # type: ignore[arg-type]
                    max_result_bytes=cfg.max_tool_response_bytes,
                    truncation_marker=cfg.tool_response_truncation_marker,
                )
        t1 = ep.clock()
        ep.event("tool", t0, t1)
        ep.tool_calls += len(calls)
        ep.metrics["tool_seconds"] += t1 - t0
        ep.metrics["tool_errors"] += sum(1 for r in results if not r.ok)
        # Which calls of which assistant turn succeeded, for per-turn rewards and analysis.
        ep.extra.setdefault("tool_results", []).append(
            {"turn": ep.assistant_turns, "ok": [r.ok for r in results], "error_kinds": [r.error_kind for r in results]}
        )
        ep.metrics["tool_results_truncated"] = ep.metrics.get("tool_results_truncated", 0.0) + sum(
            1 for r in results if r.truncated
        )
        return results


def assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The OpenAI-format assistant message of a parsed turn (also what the `openai` endpoint returns)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                # OpenAI's form: arguments as a JSON string (a malformed call keeps what the model wrote).
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False) if c.ok else c.raw},
            }
            for c in calls
        ]
    return msg


def _tool_message(r: ToolResult) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "tool", "content": r.content}
    if r.name:
        msg["name"] = r.name
    if r.call_id:
        msg["tool_call_id"] = r.call_id
    return msg
