"""agentloop: an async agent-loop rollout runtime for RL trainers, driving SGLang servers.

Layers (imports point down only; `tools/check_imports.py` LAYERS, enforced by `tests/test_imports.py`):
cli/commands → integrations → distributed (Ray) → runtime (the step, one assembly from config, engine
backends, streaming) → scheduler → config → endpoint (OpenAI endpoint + `openai` loop) → agents →
rewards/group_filters/dataset → tools/chat → output → engine (client protocol, gate, router, lifecycle,
memory mark, SGLang client, CPU reference engine) → batch/models/data/tasks → types/registry/yaml_strict/
input_budget/allocator. docs/architecture.md walks through them.
"""

__version__ = "0.1.0"
