"""Scheduling one step's trajectories: limits, GRPO groups, timeouts, over-sampling, the step watchdog.

Modules: `core.py` (`Scheduler`, the entry point), `run.py` (`ScheduleRun`: one call, orchestrating the
parts below), `book.py` (`GroupBook`: synchronous group accounting), `watchdog.py` (deadlines, hung
servers), `trajectory.py` (one agent loop, failure isolation, scoring), `result.py` (`ScheduleResult`),
`staleness.py` (`VersionLog`: how stale a token is), `feeder.py` (samples drawn as slots free),
`gc_scope.py` (the opt-in GC freeze of a step). Group filters are `agentloop.group_filters` (the
settings validate their names, below the scheduler).
"""

from .book import expand_samples
from .core import Scheduler, with_overrides
from .result import ScheduleResult

__all__ = ["ScheduleResult", "Scheduler", "expand_samples", "with_overrides"]
