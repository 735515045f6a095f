"""The garbage collector during a rollout step: `scheduler.gc_freeze`, an explicit opt-in, scoped and restored.

A step keeps thousands of objects alive for seconds (each trajectory's token buffer, coroutines,
timeline), so many survive into the collector's oldest generation and trigger full collections. A full
collection walks every tracked object of the process, and a trainer's process holds many (torch,
transformers, a model built on the meta device: ~360k objects, ~0.2 s per full collection on one core),
so on the H200-shaped workload one or two of them per step were a large share of the client's CPU per
generated token (`benchmarks/client_cpu_profile.py`, `gc_seconds_all`).

`frozen_heap(True)` moves every object that exists when the step starts into the permanent generation
(`gc.freeze()`) and puts them back into the oldest generation (`gc.unfreeze()`) when it ends, so the
step's collections walk only what the step allocated. It changes process-wide state, hence opt-in:

- while the step runs, reference cycles among objects older than the step are not collected (objects
  freed by reference counting, i.e. almost all, are freed at once as always); they are collected by the
  first full collection after the step;
- it does nothing when the collector is disabled or something else has frozen objects already
  (`gc.get_freeze_count() > 0`: the trainer's own freeze, or another runtime's step in this process), so
  it never undoes a freeze it did not make;
- a `gc.freeze()` made by someone else *during* the step is undone with ours at its end.

`collector_paused(True)` (same opt-in) turns automatic collection off for a short block on the
critical path, the streaming mode's in-flight weight update: the engine idles until it ends, and the
hundreds of aborted responses it handles at once would otherwise set off a collection right then.
Objects freed by reference counting are freed as always; the collection runs after the block.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["frozen_heap", "collector_paused"]


@contextlib.contextmanager
def frozen_heap(enabled: bool) -> Iterator[bool]:
    """Freeze the objects that exist now for the duration of the block (see the module docstring);
    yields whether it did."""
    if not enabled or not gc.isenabled() or gc.get_freeze_count():
        yield False
        return
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def collector_paused(enabled: bool) -> Iterator[bool]:
    """No automatic collection inside the block (see the module docstring); yields whether it paused."""
    if not enabled or not gc.isenabled():
        yield False
        return
    gc.disable()
    try:
        yield True
    finally:
        gc.enable()
