"""Agent loops (`single_turn`, `tool`, `interaction`, `replay`, `openai`) and their registry; see `base.py` for the contract."""

from .base import AgentConfig, AgentContext, AgentLoop, get_agent, register_agent, registered_agents


def load_builtin_agents() -> None:
    """Import the built-in loops so their `@register_agent` runs (idempotent)."""
    import importlib

    for mod in ("single_turn", "tool", "interaction_agent", "replay", "openai_agent"):
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:  # a loop not written yet must not hide the others
            if e.name != f"{__name__}.{mod}":
                raise


__all__ = ["AgentConfig", "AgentContext", "AgentLoop", "get_agent", "register_agent", "registered_agents", "load_builtin_agents"]
