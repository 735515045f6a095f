"""The engine lifecycle: drives engine servers' memory through wake and sleep, and moves the gates.

Composed of one object per job (no mixins):

- `machine.py` — `Lifecycle`, the state machine alone (wake_up / sleep / park / restore /
  update_weights_in_flight); the only writer of the state.
- `server.py` — `ServerDriver`, one per server: its memory calls, its memory mark, lease checks,
  liveness probe and attach-state resolution.
- `fleet.py` — `Fleet`: servers in and out of rotation, the gates, stages fanned out over the servers
  in rotation and recorded (`StageRecord`), the liveness probe and re-admission.
- `owner.py` — `Owner`: this lifecycle's lease (one runtime at a time).
- `types.py` — the contracts: `Weights`, `StageRecord`, `LifecycleError`, `LifecycleSettings`, ...

The memory mark's format is owned by `agentloop.engine.memory_mark` (docs/memory_mark.md) and the
state enum by `agentloop.engine.state`; both are re-exported here.
"""

from ..memory_mark import MARK_SEPARATOR, MemoryMark, served_version
from ..state import EngineState
from .fleet import Fleet
from .machine import Lifecycle
from .server import ServerDriver
from .types import SLEEP_STAGES, AttachState, LifecycleError, LifecycleSettings, StageRecord, Weights, same_weights

__all__ = ["MARK_SEPARATOR", "SLEEP_STAGES", "AttachState", "EngineState", "Fleet", "Lifecycle", "LifecycleError",
           "LifecycleSettings", "MemoryMark", "ServerDriver", "StageRecord", "Weights", "same_weights",
           "served_version"]
