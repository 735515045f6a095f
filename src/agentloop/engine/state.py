"""The states an engine fleet goes through, shared by the gate (open only while AWAKE) and the lifecycle
that moves it (`agentloop.engine.lifecycle`). Its own module so the gate, below the lifecycle, needs
nothing from it."""

from __future__ import annotations

import enum

__all__ = ["EngineState"]


class EngineState(str, enum.Enum):
    SLEEPING = "SLEEPING"
    WEIGHTS_RESUMED = "WEIGHTS_RESUMED"
    WEIGHTS_LOADED = "WEIGHTS_LOADED"
    AWAKE = "AWAKE"
    DRAINING = "DRAINING"
