"""The agent-loop contract: one async method turns a `Sample` into a `Trajectory`.

An agent loop never sees an engine: it gets `AgentContext.generate`, a callable the scheduler binds to
one trajectory (routed sticky to one server, and through the lifecycle gate). Tools are built once
per worker and shared through the context. Loops register by name and are picked per sample.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Protocol

from ..engine.base import GenerateOutput, SamplingParams
from ..types import Sample, Trajectory

if TYPE_CHECKING:  # pragma: no cover
    from ..tools.registry import ToolRegistry


class GenerateFn(Protocol):
    async def __call__(self, input_ids: list[int], sampling_params: SamplingParams) -> GenerateOutput: ...


@dataclass
class AgentConfig:
    """Per-run knobs every loop understands (loops may read more from `extra`)."""

    max_assistant_turns: int = 8
    max_user_turns: int = 4
    max_response_tokens: int = 1024
    max_context_tokens: int = 4096
    max_new_tokens_per_turn: int = 256
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=1.0))
    tool_parser: str = "hermes"
    tool_timeout: float = 30.0
    max_parallel_calls: int = 4
    max_tool_response_tokens: int = 256
    tool_response_truncate_side: str = "middle"  # left | right | middle
    extra: dict[str, Any] = field(default_factory=dict)


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


class AgentLoop(ABC):
    """Subclass, set `name`, implement `run`. Register with `@register_agent`."""

    name: ClassVar[str] = ""

    @abstractmethod
    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        """Run one episode. Must return a trajectory (status failed/aborted/truncated included)
        rather than raise for anything the model or a tool did wrong."""


_REGISTRY: dict[str, type[AgentLoop]] = {}


def register_agent(cls: type[AgentLoop]) -> type[AgentLoop]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def get_agent(name: str) -> AgentLoop:
    from . import load_builtin_agents  # noqa: F401  (registers the built-in loops)

    load_builtin_agents()
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise KeyError(f"unknown agent loop {name!r}; registered: {sorted(_REGISTRY)}") from None


def registered_agents() -> list[str]:
    from . import load_builtin_agents

    load_builtin_agents()
    return sorted(_REGISTRY)
