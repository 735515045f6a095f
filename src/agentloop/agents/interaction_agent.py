"""The `interaction` agent loop: the `tool` loop with a simulated user it cannot do without (like
verl's Interaction). After each model turn without tool calls the user says the next message or stops.

The user is chosen as in the `tool` loop (`ToolAgent.simulated_user`): `sample.extra["interaction"]`
(a registered interaction or an importable `"package.module:function"` path, see
`interaction.get_interaction`), else the context's hook (`AgentContext.interaction`). Neither → the
trajectory fails, before any generation, with an error saying how to give one (returned, never raised).
"""

from __future__ import annotations

from ..types import Sample
from .base import AgentContext
from .interaction import Interaction, registered_interactions
from .registry import register_agent
from .tool import ToolAgent


@register_agent
class InteractionAgent(ToolAgent):
    name = "interaction"

    def simulated_user(self, sample: Sample, ctx: AgentContext) -> Interaction:
        user = super().simulated_user(sample, ctx)
        if user is None:
            raise ValueError(
                f"sample {sample.uid}: the 'interaction' agent loop needs a simulated user: set the sample's "
                f"extra['interaction'] (a row's 'interaction' key) to one of {registered_interactions()} or a "
                "'package.module:function' path, or give the runtime an interaction hook"
            )
        return user
