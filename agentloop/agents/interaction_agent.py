"""The `interaction` agent loop: the `tool` loop with a simulated user it cannot do without (like
verl's Interaction). After each model turn without tool calls the user says the next message or stops.

The user is `sample.extra["interaction"]` when the sample names one (a registered interaction or an
importable `"package.module:function"` path, see `interaction.get_interaction`), else the context's
hook (`AgentContext.interaction`, the runtime-wide one). The sample's wins because it is the more
specific choice, as a sample's `agent` wins over the configured default loop. Neither → the trajectory
fails with an error saying how to give one (it is returned, never raised).
"""

from __future__ import annotations

from ..types import Sample
from .base import AgentContext, register_agent
from .interaction import Interaction, get_interaction, registered_interactions
from .tool import ToolAgent


@register_agent
class InteractionAgent(ToolAgent):
    name = "interaction"

    def simulated_user(self, sample: Sample, ctx: AgentContext) -> Interaction:
        spec = sample.extra.get("interaction")
        if spec is not None:
            try:
                return get_interaction(spec)
            except (KeyError, ImportError, TypeError) as e:
                msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
                raise ValueError(f"sample {sample.uid}: extra['interaction']: {msg}") from e
        if ctx.interaction is not None:
            return ctx.interaction
        raise ValueError(
            f"sample {sample.uid}: the 'interaction' agent loop needs a simulated user: set the sample's "
            f"extra['interaction'] (a row's 'interaction' key) to one of {registered_interactions()} or a "
            "'package.module:function' path, or give the runtime an interaction hook"
        )
