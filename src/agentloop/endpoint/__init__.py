"""The OpenAI-compatible endpoint: agents written against the OpenAI chat API, rolled out with exact tokens.

`protocol.py` is the wire format (requests, responses, stream chunks, errors), `recorder.py` answers and
records one trajectory's calls (template deltas after the sampled tokens; a rewritten history becomes a
new segment), `server.py` is the loopback aiohttp server that routes each request to its trajectory by
key, `agent.py` is the `openai` agent loop, which owns a server and binds one client per trajectory
(registered by name like every loop; docs/openai_agents.md is the user's guide).

Layering: this package sits above `agentloop.agents`: it uses the agent-loop contract (`AgentContext`,
`Episode`, `register_agent`); nothing in `agents/` imports it (the agent registry loads `agent.py` by
name, as it loads the built-in loops).
"""

from .protocol import ChatCompletionRequest, CompletionResult, EndpointError
from .recorder import TrajectoryRecorder
from .server import EndpointServer, Route

__all__ = ["ChatCompletionRequest", "CompletionResult", "EndpointError", "EndpointServer", "Route", "TrajectoryRecorder"]
