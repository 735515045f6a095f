"""What a `Runtime` step reports about itself in `StepResult.metrics`: the scheduler's numbers plus
the step's timings (wake-up, rollout, sleep), the seconds of every lifecycle stage it ran, and the
servers that left or re-entered rotation during it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..engine.lifecycle import StageRecord

__all__ = ["step_metrics"]


def step_metrics(
    scheduled: Mapping[str, Any],
    *,
    step: int,
    weight_version: str | None,
    times: tuple[float, float, float, float],
    records: Sequence[StageRecord],
    server_events: Sequence[Mapping[str, Any]],
    generations_outside_awake: int,
    out_of_rotation: Mapping[str, str],
) -> dict[str, Any]:
    """The metrics of one step. `scheduled`: the scheduler's metrics (copied, not changed); `times`:
    monotonic (start, awake, rolled out, end); `records` / `server_events`: the lifecycle's, of this step only."""
    t0, t_awake, t_rolled, t_end = times
    metrics = dict(scheduled)
    stages: dict[str, float] = {}
    for r in records:
        key = f"{r.phase}/{r.stage}"
        stages[key] = stages.get(key, 0.0) + r.seconds
    metrics.update(
        step=step,
        weight_version=weight_version,
        wake_up_seconds=t_awake - t0,
        rollout_seconds=t_rolled - t_awake,
        sleep_seconds=t_end - t_rolled,
        step_seconds=t_end - t0,
        stage_seconds=stages,
        generations_outside_awake=generations_outside_awake,
    )
    # Servers that left or re-entered rotation during the step (probe, stage, router, watchdog). In
    # place: Ray's metrics["ray"] shares the dict.
    removed = metrics.setdefault("servers_removed", {})
    for e in server_events:
        if e["event"] == "out":
            removed.setdefault(e["url"], e["reason"])
    metrics["servers_readmitted"] = [e["url"] for e in server_events if e["event"] == "in"]
    metrics["servers_out_of_rotation"] = out_of_rotation
    return metrics
