"""How busy a step kept the engines, from its trajectories' timelines: is the run throttled?

Over the step's roll-out span (first trajectory event to last), sweeping the `generate` spans of every
trajectory (minus the `wait` spans inside them, where a request waited for a per-server slot and was
not on the engine yet):

- `generate_in_flight_mean`: generate requests on the engines, averaged over the span;
- `engine_busy_fraction`: that mean over the engines' capacity (the generate requests they admit at
  once, `agentloop.runtime.concurrency`): 1.0 = every running-batch slot of every server was used the
  whole time; a run throttled by a low `scheduler.concurrency` shows a small value (32 of 1024 slots:
  <= 0.03). None when the capacity is unknown;
- `generate_busy_fraction`: the share of the span with at least one generate in flight (an engine
  idle while every trajectory runs a tool or waits shows here);
- `trajectories_in_flight_mean` and `slot_busy_fraction` (= that mean / `concurrency`): how full the
  scheduler's concurrency limit was (trajectories from their first non-queue event to their end).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from ..types import Trajectory

__all__ = ["engine_use", "total_engine_use"]


def _integral(deltas: list[tuple[float, int]], lo: float, hi: float) -> tuple[float, float]:
    """(integral of the running count over [lo, hi], time with count >= 1) for +1/-1 `deltas`."""
    deltas.sort()
    area = busy = 0.0
    count = 0
    prev = lo
    for t, d in deltas:
        t = min(max(t, lo), hi)
        if count > 0:
            area += count * (t - prev)
            busy += t - prev
        count += d
        prev = t
    return area, busy


def engine_use(trajectories: Sequence[Trajectory], *, concurrency: int | None,
               engine_capacity: int | None) -> dict[str, Any] | None:
    """The numbers above for one step (None when no trajectory recorded a timeline)."""
    events = [e for t in trajectories for e in t.timeline]
    if not events:
        return None
    lo = min(e.start for e in events)
    hi = max(e.end for e in events)
    span = hi - lo
    gen: list[tuple[float, int]] = []
    running: list[tuple[float, int]] = []
    for t in trajectories:
        work = [e for e in t.timeline if e.kind != "queue"]
        if work:
            running += [(min(e.start for e in work), 1), (max(e.end for e in work), -1)]
        for e in t.timeline:
            if e.kind == "generate":
                gen += [(e.start, 1), (e.end, -1)]
            elif e.kind == "wait":
                gen += [(e.start, -1), (e.end, 1)]
    if span <= 0:
        return {"span_seconds": 0.0, "concurrency": concurrency, "engine_capacity": engine_capacity,
                "generate_in_flight_mean": None, "engine_busy_fraction": None, "generate_busy_fraction": None,
                "trajectories_in_flight_mean": None, "slot_busy_fraction": None}
    g_area, g_busy = _integral(gen, lo, hi)
    r_area, _ = _integral(running, lo, hi)
    in_flight = g_area / span
    traj_in_flight = r_area / span
    return {
        "span_seconds": round(span, 6),
        "concurrency": concurrency,
        "engine_capacity": engine_capacity,
        "generate_in_flight_mean": round(in_flight, 3),
        "engine_busy_fraction": round(in_flight / engine_capacity, 4) if engine_capacity else None,
        "generate_busy_fraction": round(g_busy / span, 4),
        "trajectories_in_flight_mean": round(traj_in_flight, 3),
        "slot_busy_fraction": round(traj_in_flight / concurrency, 4) if concurrency else None,
    }


def total_engine_use(steps: Iterable[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The run's figures: each step's means weighted by its span (the same definitions, over all steps)."""
    parts = [s for s in steps if s and s.get("span_seconds")]
    if not parts:
        return None
    span = sum(s["span_seconds"] for s in parts)

    def weighted(key: str) -> float | None:
        vals = [(s[key], s["span_seconds"]) for s in parts if s.get(key) is not None]
        if len(vals) != len(parts):
            return None
        return round(sum(v * w for v, w in vals) / span, 4)

    conc = {s.get("concurrency") for s in parts}
    cap = {s.get("engine_capacity") for s in parts}
    return {
        "span_seconds": round(span, 6),
        "concurrency": conc.pop() if len(conc) == 1 else sorted(c for c in conc if c is not None),
        "engine_capacity": cap.pop() if len(cap) == 1 else None,
        "generate_in_flight_mean": weighted("generate_in_flight_mean"),
        "engine_busy_fraction": weighted("engine_busy_fraction"),
        "generate_busy_fraction": weighted("generate_busy_fraction"),
        "trajectories_in_flight_mean": weighted("trajectories_in_flight_mean"),
        "slot_busy_fraction": weighted("slot_busy_fraction"),
    }
