"""agentloop: an async agent-loop rollout runtime for RL trainers, driving SGLang servers.

Layers (imports point down only): cli → runtime → scheduler → agents → tools/chat/rewards →
engine (client protocol, lifecycle gate, SGLang client, router, CPU reference engine).
"""

__version__ = "0.1.0"
