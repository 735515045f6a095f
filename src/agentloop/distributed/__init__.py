"""Ray mode of the runtime: agent-loop workers and engine servers as Ray actors, across machines.

`RayRuntime` is `agentloop.runtime.Runtime` with the same `step` and the same `StepResult`; see
`docs/distributed.md` for running it on a cluster. Modules:

- `runtime.py`: the driver (`RayRuntime`, its `RayRollout` and remote scheduler; the lifecycle is the
  ordinary one); its settings are `agentloop.config.RayConfig` (`RuntimeConfig.ray`);
- `pool.py`: handing trajectories to workers as they free up, and surviving worker deaths;
- `pool.py` is also the lifecycle's `GateControl` over every worker's gate;
- `worker.py`: the worker actor (its `Gate`, its router, its scheduler);
- `engines.py`: engine server actors (CPU engine or SGLang) and GPU placement groups.

Needs `ray` (`pip install 'agentloop[ray]'`) and the asyncio event loop.
"""

from .engines import EngineFleet, EngineServer, EngineSpec, RayFleetEngines, ray_engine_backend
from .pool import NoWorkerError, WorkerPool, WorkerStartError
from .runtime import RayRollout, RayRuntime, RayScheduler, RemoteAgent
from .worker import PinnedRouter, RolloutWorker

__all__ = [
    "EngineFleet", "EngineServer", "EngineSpec", "NoWorkerError", "PinnedRouter", "RayFleetEngines", "RayRollout",
    "RayRuntime", "RayScheduler", "RemoteAgent", "RolloutWorker", "WorkerPool", "WorkerStartError", "ray_engine_backend",
]
