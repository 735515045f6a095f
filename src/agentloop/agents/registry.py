"""The agent loops by name, and the list of the built-in ones (samples pick a loop by `agent`).

`BUILTIN_AGENT_MODULES` are imported on the first lookup (each registers its loop with
`@register_agent`); they import this module, so it cannot import them at its top. The `openai` loop
lives with the endpoint it serves (`agentloop.endpoint.agent`).
"""

from __future__ import annotations

from ..registry import Registry
from .base import AgentLoop

__all__ = ["AGENT_LOOPS", "BUILTIN_AGENT_MODULES", "get_agent", "register_agent", "registered_agents"]

#: Modules whose import registers a built-in loop: single_turn, tool, interaction, replay, openai.
BUILTIN_AGENT_MODULES = (
    "agentloop.agents.single_turn",
    "agentloop.agents.tool",
    "agentloop.agents.interaction_agent",
    "agentloop.agents.replay",
    "agentloop.endpoint.agent",
)


def _check(name: str, cls: type[AgentLoop]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
        raise TypeError(f"agent loop {name!r}: {cls!r} is not an AgentLoop subclass")


AGENT_LOOPS: Registry[type[AgentLoop]] = Registry("agent loop", check=_check, builtins=BUILTIN_AGENT_MODULES)


def register_agent(cls: type[AgentLoop]) -> type[AgentLoop]:
    """Class decorator: registers the loop under its `name`."""
    if not getattr(cls, "name", ""):
        raise ValueError(f"{cls.__name__} has no name")
    return AGENT_LOOPS.add(cls.name, cls)


def get_agent(name: str) -> AgentLoop:
    """A new instance of the loop registered as `name` (KeyError naming the registered ones)."""
    return AGENT_LOOPS.get(name)()


def registered_agents() -> list[str]:
    return AGENT_LOOPS.names()
