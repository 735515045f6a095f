"""Priority scheduling for the CPU engine, with SGLang's flags and rules (sglang 0.5.17,
`--enable-priority-scheduling`, `SchedulePolicy._sort_by_priority_and_fcfs`,
`PrefillAdder.preempt_to_schedule`).

- A request's `priority` is an integer; by default a higher value is served first
  (`--schedule-low-priority-values-first` turns that round). A request without one gets the worst
  possible value (SGLang: `-sys.maxsize - 1`, or `sys.maxsize` when low values go first).
- The waiting queue is admitted best priority first, arrival order among equals.
- Preemption (on unless `--disable-priority-preemption`): when the running batch is full, a waiting
  request whose priority beats a running one's by more than `--priority-scheduling-preemption-threshold`
  (default 10) takes its place; the preempted request goes back to the queue with the tokens it has
  (re-prefilled when admitted again, as a retraction is). Victims are the worst running requests,
  the most recently queued first.

Without `--enable-priority-scheduling` a request's priority is ignored (and, with
`--abort-on-priority-when-disabled`, the request is refused), as SGLang does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable, Sequence

from .request import Request

__all__ = ["PriorityPolicy"]


@dataclass(frozen=True)
class PriorityPolicy:
    """How the scheduler orders its queue and whom it preempts (`enabled=False`: arrival order, no preemption)."""

    enabled: bool = False
    low_values_first: bool = False
    preemption: bool = True
    preemption_threshold: int = 10
    abort_when_disabled: bool = False

    def value(self, req: Request) -> int:
        """The request's priority, with SGLang's default for one that gave none."""
        if req.priority is not None:
            return req.priority
        return sys.maxsize if self.low_values_first else -sys.maxsize - 1

    def _rank(self, req: Request) -> int:
        """Lower is served first."""
        p = self.value(req)
        return p if self.low_values_first else -p

    def order(self, waiting: Iterable[Request]) -> list[Request]:
        """The queue in admission order: best priority first, then arrival (a stable sort)."""
        return sorted(waiting, key=self._rank)

    def victims(self, candidate: Request, running: Sequence[Request], need: int) -> list[Request]:
        """Up to `need` running requests `candidate` may preempt: worst priority first (among equals
        the most recently queued), each beaten by more than the threshold."""
        if not (self.enabled and self.preemption) or need <= 0:
            return []
        worst_first = sorted((r for r in running if not r.finished), key=lambda r: (-self._rank(r), -r.queued))
        out: list[Request] = []
        for r in worst_first[:need]:
            if self._rank(r) - self._rank(candidate) > self.preemption_threshold:
                out.append(r)
            else:
                break
        return out
