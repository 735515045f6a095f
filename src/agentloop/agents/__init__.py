"""Agent loops (`single_turn`, `tool`, `interaction`, `replay`; `openai` lives in `agentloop.endpoint`)
and their registry (`registry.py`, with the list of the built-in loops); see `base.py` for the contract."""

from .base import AgentConfig, AgentContext, AgentLoop, SamplingConfig
from .registry import get_agent, register_agent, registered_agents

__all__ = ["AgentConfig", "AgentContext", "AgentLoop", "SamplingConfig", "get_agent", "register_agent",
           "registered_agents"]
