"""Settings: the runtime's pydantic models and the `agentloop rollout` file.

Modules: `settings.py` (`RuntimeConfig` and its sections), `scheduler.py` (its `SchedulerConfig`
section), `strict.py` (the models' base: unknown keys refused), `rollout.py` (`RolloutConfig`: the
command's file and flags). Both files are read with `agentloop.yaml_strict` (duplicate keys refused, node positions kept).
"""

from .settings import (EngineConfig, LaunchConfig, LocalServerConfig, RayConfig, RuntimeConfig, SamplingConfig,
                       SchedulerConfig)

__all__ = ["EngineConfig", "LaunchConfig", "LocalServerConfig", "RayConfig", "RuntimeConfig", "SamplingConfig",
           "SchedulerConfig"]
