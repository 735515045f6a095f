"""Settings: the runtime's pydantic models and the `agentloop rollout` file.

Modules: `settings.py` (`RuntimeConfig` and its sections), `rollout.py` (`RolloutConfig`: the command's
file and flags), `yaml_strict.py` (YAML with duplicate keys refused and node positions kept).
"""

from .settings import EngineConfig, LaunchConfig, RayConfig, RuntimeConfig, SchedulerConfig

__all__ = ["EngineConfig", "LaunchConfig", "RayConfig", "RuntimeConfig", "SchedulerConfig"]
