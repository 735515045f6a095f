"""The trainer-facing runtime: `Runtime` (one step = wake → roll out → collate → sleep) and what it returns.

Modules: `core.py` (`Runtime`), `sync.py` (the blocking facade, `step_sync`), `types.py` (`StepResult`,
`StepStream`, the step errors), `inputs.py` (a step's argument checks, before any wake-up), `metrics.py`
(a step's numbers), `assembly.py` (lifecycle, router, scheduler, tools from config; where the agent
loops run: `LocalRollout`), `backends.py` (where the engines come from: one strategy per `engine`
mode), `engines.py` (how engines, clients and the tokenizer are obtained), `concurrency.py`
(`scheduler.concurrency: auto`, from what the engines report they can run).
"""

from .core import OnTrajectory, Runtime
from .types import AgentloopError, StepCollateError, StepError, StepResult, StepSleepError, StepStream, StreamBlock

__all__ = ["AgentloopError", "OnTrajectory", "Runtime", "StepCollateError", "StepError", "StepResult",
           "StepSleepError", "StepStream", "StreamBlock"]
