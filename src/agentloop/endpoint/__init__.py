"""The OpenAI-compatible endpoint: agents written against the OpenAI chat API, rolled out with exact tokens.

`protocol.py` is the wire format (requests, responses, stream chunks, errors), `recorder.py` answers and
records one trajectory's calls (template deltas after the sampled tokens; a rewritten history becomes a
new segment), `server.py` is the loopback aiohttp server that routes each request to its trajectory by
key. The `openai` agent loop (`agentloop.agents.openai_agent`) owns a server and binds one client per
trajectory; docs/openai_agents.md is the user's guide.

Layering: this package sits beside `agentloop.agents`, above the engine: it uses the agent-loop
contract (`AgentContext`, `Episode`) and is used by the `openai` loop only.
"""

from .protocol import ChatCompletionRequest, CompletionResult, EndpointError
from .recorder import TrajectoryRecorder
from .server import EndpointServer, Route

__all__ = ["ChatCompletionRequest", "CompletionResult", "EndpointError", "EndpointServer", "Route", "TrajectoryRecorder"]
