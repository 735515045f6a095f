"""Ray mode of the runtime: agent-loop workers and engine servers as Ray actors, across machines.

`RayRuntime` is `agentloop.runtime.Runtime` with the same `step` and the same `StepResult`; see
`docs/distributed.md` for running it on a cluster. Modules:

- `runtime.py`: the driver (`RayRuntime`, the fanned-out lifecycle, the remote scheduler); its
  settings are `agentloop.config.RayConfig` (`RuntimeConfig.ray`), re-exported here;
- `pool.py`: handing trajectories to workers as they free up, and surviving worker deaths;
- `worker.py`: the worker actor (its gate, its router, its scheduler);
- `engines.py`: engine server actors (CPU engine or SGLang) and GPU placement groups.

Needs `ray` (`pip install 'agentloop[ray]'`) and the asyncio event loop.
"""

from .engines import EngineFleet, EngineServer, EngineSpec
from .pool import NoWorkerError, WorkerPool, WorkerStartError
from .runtime import FanOutLifecycle, RayConfig, RayRuntime, RayScheduler, RemoteAgent
from .worker import PinnedRouter, RolloutWorker, WorkerGate

__all__ = [
    "EngineFleet", "EngineServer", "EngineSpec", "FanOutLifecycle", "NoWorkerError", "PinnedRouter", "RayConfig",
    "RayRuntime", "RayScheduler", "RemoteAgent", "RolloutWorker", "WorkerGate", "WorkerPool", "WorkerStartError",
]
