"""The state of one `agentloop rollout` run, shared by the modules of the command: its settings and
data, one record per step (trajectories, lifecycle stage records, metrics, launched and carried
prompts), the trajectory stream, and what stopped or failed it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..dataset import Dataset
from ..engine.lifecycle import StageRecord
from ..output.writer import TrajectoryStream
from ..output.progress import RolloutProgress
from ..config.rollout import RolloutConfig
from ..types import Trajectory

__all__ = ["CommandRun", "StepRecord"]


@dataclass
class StepRecord:
    step: int
    trajectories: list[Trajectory] = field(default_factory=list)
    records: list[StageRecord] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None
    #: {prompt (group) uid: trajectories launched} and the groups continued next step.
    launched: dict[str, int] = field(default_factory=dict)
    carried: set[str] = field(default_factory=set)


@dataclass
class CommandRun:
    cfg: RolloutConfig
    dataset: Dataset
    progress: RolloutProgress
    steps: list[StepRecord] = field(default_factory=list)
    stream: TrajectoryStream | None = None
    interrupted: bool = False
    error: str | None = None
    engine_urls: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    written: list[Path] = field(default_factory=list)
    runtime: Any = None
    in_step: bool = False
    #: Output files that could not be written ("name: reason"); the first stops the run.
    write_errors: list[str] = field(default_factory=list)
    #: Fresh prompts drawn from the dataset so far (more than its rows: it wrapped around).
    drawn: int = 0
