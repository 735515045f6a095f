"""The `single_turn` agent loop: one model turn on the prompt, no tools.

Completed when the engine stopped on its own, truncated when `max_new_tokens` or the token budget cut
it, aborted when the engine aborted the request (a resumed sample continues the partial turn),
failed on an unexpected exception (returned, never raised).
"""

from __future__ import annotations

from ..types import Sample, Trajectory
from .base import AgentContext, AgentLoop
from .registry import register_agent
from .episode import BudgetSpent, Episode


@register_agent
class SingleTurnAgent(AgentLoop):
    name = "single_turn"

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        try:
            ep = Episode.start(sample, ctx, tools=sample.tools)
        except Exception as e:
            return Episode.failed_before_start(sample, ctx, e)
        try:
            out = await ep.generate()
            ep.show_assistant({"role": "assistant", "content": ep.turn_text()})
            if out.aborted:
                ep.finish("aborted", "abort")
            elif out.finish_type == "length":
                ep.finish("truncated", ep.extra.get("turn_cut_by", "length"))
            else:
                ep.finish("completed", "stop")
        except BudgetSpent as b:
            ep.finish("truncated", b.reason)
        except Exception as e:
            ep.fail(e)
        return ep.trajectory()
