"""What the streaming mode hands a trainer (`StreamBatch`) and how it is tuned (`StreamConfig`).

Staleness of a token = how many weight updates lie between the weights that sampled it and the
weights served when the trainer takes it (0 = on-policy); the versions' order is the scheduler's
`VersionLog` (`agentloop.scheduler.staleness`), shared with the runtime's steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..batch import RolloutBatch
from ..types import Trajectory

__all__ = ["DrainBy", "KvOnUpdate", "StalePolicy", "StreamBatch", "StreamConfig"]

StalePolicy = Literal["drop", "restart"]
KvOnUpdate = Literal["recompute", "reuse"]
DrainBy = Literal["server", "client"]


@dataclass
class StreamConfig:
    """How a `RolloutStream` runs (see `agentloop.runtime.stream`).

    - `batch_groups`: complete, accepted groups per `StreamBatch`.
    - `active`: trajectories kept in flight (the engine's fill; ≫ a batch, like the steady state of a
      bare client that refills a finished trajectory's slot at once).
    - `max_queued_batches`: the bound of the queue to the trainer; once that many batches (complete
      groups included that are not yet batched) wait, nothing new is admitted (backpressure).
    - `max_staleness` (AReaL's η): a group is admitted only while the groups running or accepted
      so far (a failed, rejected or stale group gives its place back) ≤ (updates applied + η + 1) × batch_groups, and a complete group whose oldest first token is more
      than η versions behind the served version when it is handed out is handled by `stale_policy`.
      None: no bound (only `active` and the queue limit admission).
    - `stale_policy`: "drop" (the group is discarded and counted) or "restart" (its prompt is
      admitted again from scratch, counted). Dropping biases the batches against long trajectories;
      restarting costs their compute again. Both are counted in `RolloutStream.metrics`.
    - `kv_on_update`: what becomes of the engine's prefix (KV) cache at an in-flight weight update.
      "recompute" (AReaL's choice) flushes it with the load: every interrupted turn and every later
      turn prefills its whole context under the new weights, so each token is sampled by one weight
      set end to end — at the cost of re-prefilling every context in flight after each update.
      "reuse" (PipelineRL's choice) keeps it: a turn cut by the update goes on from the KV the old
      weights wrote (no re-prefill), so tokens sampled after the update by the new weights attend to
      a prefix the old weights encoded until those contexts leave the cache. Either way a token's
      recorded version is the weights that sampled it and its logprob is the one it was sampled with
      (the behaviour policy, exactly); with "reuse" that policy is the new weights over a partly stale
      KV prefix, which off-policy corrections (importance ratios against the recorded logprobs)
      handle but which no single weight version reproduces.
    - `drain`: who drains the engines for an in-flight update (`Lifecycle.update_weights_drained`).
      "client" (default): abort every request and load once every aborted answer is back here —
      the drain every committed GPU measurement of streaming used (benchmarks/README.md, issue 27).
      "server": the load goes out with `abort_all_requests` and the server loads once its generates
      ended (SGLang's `model_update_lock`) while this process parses the aborted answers. It has no
      committed GPU result yet (one H100 run, whose JSON was lost, gave 0.74 s per update against
      0.63 s for "client" at 768 in flight), so it is not the default; `benchmarks/continuous.py`'s
      mode `streaming_kv_reuse_server_drain` measures the two side by side.
    """

    batch_groups: int
    active: int
    max_queued_batches: int = 2
    max_staleness: int | None = None
    stale_policy: StalePolicy = "drop"
    kv_on_update: KvOnUpdate = "recompute"
    drain: DrainBy = "client"

    def __post_init__(self) -> None:
        for name, low in (("batch_groups", 1), ("active", 1), ("max_queued_batches", 1), ("max_staleness", 0)):
            value = getattr(self, name)
            if name == "max_staleness" and value is None:
                continue
            if not _is_int(value) or value < low:
                kind = "None or an int" if name == "max_staleness" else "an int"
                raise ValueError(f"StreamConfig.{name} must be {kind} >= {low}, got {value!r}")
        if self.stale_policy not in ("drop", "restart"):
            raise ValueError(f"StreamConfig.stale_policy must be 'drop' or 'restart', got {self.stale_policy!r}")
        if self.kv_on_update not in ("recompute", "reuse"):
            raise ValueError(f"StreamConfig.kv_on_update must be 'recompute' or 'reuse', got {self.kv_on_update!r}")
        if self.drain not in ("server", "client"):
            raise ValueError(f"StreamConfig.drain must be 'server' or 'client', got {self.drain!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not a count


@dataclass
class StreamBatch:
    """Complete groups handed to the trainer. `trajectories` are training rows (a split trajectory is
    one row per segment), `batch` their padded tensors with per-token weight versions. `weight_version`
    is the version served when the batch was handed out; `staleness` maps versions behind it → mask-1
    tokens (the staleness histogram of this batch's trained tokens)."""

    index: int
    weight_version: str | None
    groups: list[list[Trajectory]]
    trajectories: list[Trajectory]
    batch: RolloutBatch
    staleness: dict[int, int] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
