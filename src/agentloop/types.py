"""Data contracts shared by every layer: a prompt `Sample` in, a `Trajectory` out.

The invariant a trainer relies on: positions of `response_ids` with `response_mask == 1` hold exactly
the tokens the engine sampled, in order, and `response_logprobs` at those positions are the engine's
logprobs of them (0.0 at mask-0 positions). Nothing is decoded and re-encoded on the way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

TrajectoryStatus = Literal["completed", "truncated", "aborted", "failed"]
STATUSES: tuple[str, ...] = ("completed", "truncated", "aborted", "failed")
#: Statuses of a trajectory that ran to its end and can be trained on (the others are failed/aborted).
FINISHED_OK: tuple[str, ...] = ("completed", "truncated")


@dataclass
class Sample:
    """One prompt row. `messages` is OpenAI chat format; `tools` OpenAI function schemas (or None = the
    agent's configured tools); `agent` picks the agent loop by registry name (None: the runtime's
    default, `AgentConfig.agent`, itself "tool" by default); `ground_truth` and
    `reward` (a reward-function name; None: the runtime's default, `SchedulerConfig.reward`) feed the
    reward, with `reward_kwargs` passed to that function as keyword arguments; `extra` is carried
    through untouched."""

    uid: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    agent: str | None = None
    ground_truth: Any = None
    reward: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: Set by the scheduler: GRPO group (the prompt) and the index within the group.
    group_id: str = ""
    index_in_group: int = 0
    #: A partial trajectory from an earlier step to continue (partial rollout), if any.
    resume_from: "Trajectory | None" = None
    #: Keyword arguments for the reward function (from a row's `reward` spec), e.g. `{"tolerance": 0.01}`.
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TurnRecord:
    """One model turn: where its tokens sit in `response_ids`, what the engine said about them."""

    start: int
    length: int
    weight_version: str
    finish_reason: dict[str, Any]
    server_url: str = ""
    generate_seconds: float = 0.0
    cached_tokens: int = 0


@dataclass
class TimelineEvent:
    """A span of one trajectory's wall time, for the timeline plot: kind is generate|tool|wait|queue."""

    kind: str
    start: float
    end: float


@dataclass
class Trajectory:
    uid: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    weight_version: str = ""
    num_turns: int = 0
    tool_calls: int = 0
    status: TrajectoryStatus = "completed"
    finish_reason: str = ""
    reward: float | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    timeline: list[TimelineEvent] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    index_in_group: int = 0
    #: Earlier training segments of this trajectory, each a complete token sequence of its own: an
    #: agent that rewrote its history (the `openai` loop) left these conversations behind. This
    #: trajectory is the last segment; `training_rows` lays them out as rows (docs/openai_agents.md).
    segments: list["Trajectory"] = field(default_factory=list)

    @property
    def weight_versions(self) -> list[str]:
        """Weight version of each model turn (a partial rollout can span versions)."""
        return [t.weight_version for t in self.turns]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_invariants(self) -> None:
        """Raise ValueError if lengths disagree or a mask-1 span is not a recorded model turn."""
        n = len(self.response_ids)
        if len(self.response_mask) != n or len(self.response_logprobs) != n:
            raise ValueError(
                f"trajectory {self.uid}: response_ids={n} response_mask={len(self.response_mask)} "
                f"response_logprobs={len(self.response_logprobs)} differ"
            )
        covered = [0] * n
        for t in self.turns:
            if 0 <= t.start <= t.start + t.length <= n:
                covered[t.start:t.start + t.length] = [1] * t.length  # collate checks every token: per turn, not per id
            else:  # out of range: the per-id loop's IndexError (or negative-index wrap), as always
                for i in range(t.start, t.start + t.length):
                    covered[i] = 1
        if covered != list(self.response_mask):
            raise ValueError(f"trajectory {self.uid}: response_mask does not match the recorded model turns")
        for seg in self.segments:
            seg.check_invariants()


def training_rows(trajectories: "list[Trajectory]") -> "list[Trajectory]":
    """One row per token sequence: each trajectory's earlier `segments` (given the trajectory's reward,
    status and finish reason: one outcome for the whole run), then the trajectory itself without them.
    Trajectories without segments pass through as they are."""
    rows: list[Trajectory] = []
    for t in trajectories:
        if not t.segments:
            rows.append(t)
            continue
        for seg in t.segments:
            rows.append(replace(seg, reward=t.reward, status=t.status, finish_reason=t.finish_reason,
                                error=t.error, index_in_group=t.index_in_group, group_id=t.group_id))
        rows.append(replace(t, segments=[]))
    return rows
