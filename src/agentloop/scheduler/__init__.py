"""Scheduling one step's trajectories: limits, GRPO groups, timeouts, over-sampling, the step watchdog.

Modules: `core.py` (`Scheduler` and one run of it), `groups.py` (GRPO groups and their accounting),
`watch.py` (deadlines, the step watchdog), `result.py` (`ScheduleResult`), `gc_scope.py` (the opt-in GC freeze of a step). Group filters
are `agentloop.group_filters` (the settings validate their names, below the scheduler).
"""

from .core import Scheduler, with_overrides
from .groups import expand_samples
from .result import ScheduleResult

__all__ = ["ScheduleResult", "Scheduler", "expand_samples", "with_overrides"]
