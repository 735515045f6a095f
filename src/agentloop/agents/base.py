"""The agent-loop contract: one async method turns a `Sample` into a `Trajectory`.

An agent loop never sees an engine: it gets `AgentContext.generate`, a callable the scheduler binds to
one trajectory (routed sticky to one server, and through the lifecycle gate). Tools are built once
per worker and shared through the context. Loops register by name (`agents.registry`) and are picked
per sample.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, ContextManager, Literal, Mapping, Protocol

import anyio

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..engine.base import GenerateOutput, SamplingParams
from ..tools.truncate import DEFAULT_MARKER, DEFAULT_MAX_BYTES, check_marker
from ..types import Sample, Trajectory

if TYPE_CHECKING:  # pragma: no cover
    from ..tools.registry import ToolRegistry


class GenerateFn(Protocol):
    async def __call__(self, input_ids: list[int], sampling_params: SamplingParams) -> GenerateOutput: ...


class StopSignal(Protocol):
    """How a trajectory learns that the scheduler stopped it (the scheduler's route session is one)."""

    @property
    def stopped(self) -> bool: ...

    def interruptible(self) -> ContextManager[anyio.CancelScope]: ...


class SamplingConfig(BaseModel):
    """How each model turn samples: `AgentConfig.sampling` (the YAML's `agent: {sampling: {...}}`).
    `params(max_new_tokens)` is the `SamplingParams` of one turn."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(-1, description="Top-k sampling (-1: off).")
    min_p: float = Field(0.0, ge=0, le=1, description="Min-p sampling threshold.")
    seed: int | None = Field(
        None,
        description="Sampling seed (None: unseeded). Each model turn of each sample is sent a seed derived from it, "
        "the sample's uid, its index in the group and the turn: the samples of a group stay distinct and a re-run "
        "with the same seed repeats exactly.",
    )
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="More SGLang `sampling_params` sent with every model turn, as given (e.g. {repetition_penalty: "
        "1.1, stop_token_ids: [7]}).",
    )

    def params(self, max_new_tokens: int) -> SamplingParams:
        """The `SamplingParams` of one model turn of at most `max_new_tokens` tokens (a new object at each
        call: build it once and `replace` per turn). `seed` is sent as `sampling_seed`; `extra` as given."""
        seed = {} if self.seed is None else {"sampling_seed": self.seed}  # unseeded: no field (not an explicit null)
        return SamplingParams.from_mapping({
            "max_new_tokens": max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, **seed, **self.extra})


#: The flat `AgentConfig` spellings that moved into `AgentConfig.sampling` → their name there.
_MOVED_TO_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "seed": "seed", "sampling_extra": "extra"}


class AgentConfig(BaseModel):
    """Per-run knobs every agent loop understands. The one model for them: `RuntimeConfig.agent` (the
    YAML's `runtime.agent`, `agentloop config --show`) is this class. Loops may read more from `extra`.

    `sampling` is a `SamplingConfig`; `turn_sampling()` gives the `SamplingParams` of one model turn."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    agent: str | None = Field("tool", description="Agent loop (registry name) for samples that name none (None: 'tool').")
    tools: str | None = Field(None, description="Tool YAML config file. None: the built-in tools.")
    max_assistant_turns: int = Field(8, ge=1, description="Most model turns in one trajectory.")
    max_user_turns: int = Field(4, ge=0, description="Most simulated-user turns in one trajectory.")
    max_response_tokens: int = Field(1024, ge=1, description="Token budget of the whole response (all turns, tool tokens included).")
    max_context_tokens: int = Field(4096, ge=1, description="Prompt + response may not exceed this (the engine's context).")
    max_new_tokens_per_turn: int = Field(256, ge=1, description="Most tokens one model turn may generate.")
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig,
        description="How each model turn samples (temperature, top_p, top_k, min_p, seed, extra).")
    tool_parser: str = Field("hermes", description="Tool-call parser name (see `agentloop.tools.parsers`).")
    tool_timeout: float = Field(30.0, gt=0, description="Seconds one tool call may take.")
    max_parallel_calls: int = Field(4, ge=1, description="Tool calls of one turn run concurrently up to this many.")
    max_tool_response_tokens: int = Field(256, ge=1, description="Tool results are truncated to this many tokens.")
    tool_response_truncate_side: Literal["left", "right", "middle"] = Field(
        "middle", description="Which part of a long tool result is cut."
    )
    max_tool_response_bytes: int = Field(
        DEFAULT_MAX_BYTES, ge=1, description="UTF-8 bytes of a tool's output kept while it is produced (the rest is "
        "dropped as it arrives, so a flood or an endless stream keeps memory flat); then max_tool_response_tokens applies.")
    tool_response_truncation_marker: str = Field(
        DEFAULT_MARKER, description="Text put where tool output was cut; {n} is the amount dropped and {unit} 'tokens' "
        "or 'bytes'.")
    interaction_timeout: float = Field(
        60.0, gt=0, description="Seconds the simulated user (a sample's `interaction`) may take to answer one turn."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the tokenizer's `apply_chat_template`, used for the prompt and every turn "
        "delta (e.g. {enable_thinking: false}).",
    )
    function: str | None = Field(
        None, description="The `openai` agent loop's agent function, 'package.module:function' (async (client, sample) "
        "-> result; docs/openai_agents.md); a sample's extra['function'] overrides it.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Free settings for custom agent loops (`ctx.config.extra`).")

    @model_validator(mode="before")
    @classmethod
    def _sampling_is_nested(cls, data: Any) -> Any:
        """The flat sampling spellings (`agent.temperature`, `agent.sampling_extra`) moved into `agent.sampling`:
        refuse them, naming where to write them (silently dropping a temperature would change a run)."""
        if isinstance(data, Mapping):
            flat = [k for k in data if k in _MOVED_TO_SAMPLING]
            if flat:
                raise ValueError("; ".join(f"agent.{k}: write it as agent.sampling.{_MOVED_TO_SAMPLING[k]}"
                                           for k in flat))
        return data

    @field_validator("tool_response_truncation_marker")
    @classmethod
    def _marker_is_a_template(cls, v: str) -> str:
        return check_marker(v)

    @field_validator("extra")
    @classmethod
    def _extra_is_not_a_setting(cls, v: dict[str, Any]) -> dict[str, Any]:
        """A setting written into `extra` would be silently ignored there: refuse it, naming the setting."""
        settings = sorted(set(v) & set(cls.model_fields))
        if settings:
            raise ValueError(f"extra.{settings[0]}: `{settings[0]}` is a setting of its own (agent.{settings[0]}), "
                             "not a free key of `extra`")
        sampling = sorted(set(v) & set(_MOVED_TO_SAMPLING))
        if sampling:
            raise ValueError(f"extra.{sampling[0]}: `{sampling[0]}` is a setting of its own (agent.sampling."
                             f"{_MOVED_TO_SAMPLING[sampling[0]]}), not a free key of `extra`")
        return v

    def turn_sampling(self) -> SamplingParams:
        """The `SamplingParams` of one model turn (`max_new_tokens` = `max_new_tokens_per_turn`), a new
        object at each call: build it once per episode (or call site) and `replace` per turn."""
        return self.sampling.params(self.max_new_tokens_per_turn)


def sample_seed(seed: int, uid: str, index: int, turn: int = 0) -> int:
    """The `sampling_seed` of one model turn of one sample, derived from the run's `seed`.

    One seed sent with every request would make the `n` samples of a GRPO group draw the same
    tokens (identical responses, zero advantage); mixing in the sample's uid (its prompt's), its
    index in the group and the turn keeps every draw distinct while a re-run with the same seed
    repeats exactly. Kept below 2**31 so any engine's integer seed field takes it."""
    digest = hashlib.blake2b(f"{seed}\x00{uid}\x00{index}\x00{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


@dataclass
class AgentContext:
    generate: GenerateFn
    tokenizer: Any
    config: AgentConfig
    tools: "ToolRegistry | None" = None
    #: Optional simulated user: (messages, sample) -> next user message text, or None to stop.
    interaction: Callable[[list[dict[str, Any]], Sample], Awaitable[str | None] | str | None] | None = None
    #: Wall clock for timeline events (the scheduler passes a shared monotonic clock).
    clock: Callable[[], float] | None = None
    #: The scheduler's stop of this trajectory (an early stop, a sleep, a timeout); None: never stopped.
    stop: StopSignal | None = None

    def interruptible(self) -> ContextManager[anyio.CancelScope]:
        """A cancel scope that a stop of this trajectory cancels (at once if it is stopped already):
        wrap waits between model turns (tool calls, a simulated user) in it, so that a stopped
        trajectory ends now, with its tokens, instead of after the wait. `scope.cancel_called`
        afterwards says the wait was cut (the loop then ends its trajectory as aborted)."""
        return self.stop.interruptible() if self.stop is not None else anyio.CancelScope()


class AgentLoop(ABC):
    """Subclass, set `name`, implement `run`. Register with `@register_agent` (`agents.registry`)."""

    name: ClassVar[str] = ""

    @abstractmethod
    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        """Run one episode. Must return a trajectory (status failed/aborted/truncated included)
        rather than raise for anything the model or a tool did wrong."""

    async def aclose(self) -> None:
        """Release what the loop holds across trajectories (e.g. the `openai` loop's server); the
        scheduler calls it when the runtime stops. Default: nothing to release."""
