"""The one assembly from config: the lifecycle, router, scheduler and tools a `RuntimeConfig` asks for.

This module owns *how settings become objects*; `Runtime`, `RayRuntime`'s driver and every Ray
worker build their parts here, so a setting is read in one place:

- `make_lifecycle(clients, config, reload_path)`: the `Lifecycle` over the engines (`engine.*`).
- `make_router(gate, config, ...)`: a `Router` (or a subclass: the Ray worker's `PinnedRouter`)
  with the scheduler's per-server limit, slot order, retries and the engines' request timeout.
- `make_scheduler(router, config, ...)`: a `Scheduler` with the agent settings, the step watchdog.
- `load_tools(config)`: the tool registry of `agent.tools` (the built-ins when unset).

Where the agent loops run is a strategy object, a `RolloutBackend`: `LocalRollout` (this process: the
router over the lifecycle's gate, the scheduler over it) or `agentloop.distributed.RayRollout` (the
worker actors). Where the engines come from is the other strategy, `runtime.backends.EngineBackend`.
Each strategy registers its own teardown on the runtime's exit stack when it starts a part, so a
failure part-way stops exactly what was started, in reverse order.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Protocol, Sequence

from ..agents.base import AgentLoop
from ..config.settings import RuntimeConfig, SchedulerConfig
from ..engine.base import EngineClient
from ..engine.gate import Gate
from ..engine.lifecycle import Lifecycle
from ..engine.router import Router
from ..scheduler.core import ScheduleResult, Scheduler
from ..types import Sample

log = logging.getLogger(__name__)

__all__ = ["LocalRollout", "RolloutBackend", "RolloutParts", "StepScheduler", "load_tools", "make_lifecycle", "make_router",
           "make_scheduler", "on_teardown"]


def make_lifecycle(clients: Sequence[EngineClient], config: RuntimeConfig, reload_path: str | None) -> Lifecycle:
    """The lifecycle over `clients`, from `engine.*` (`reload_path`: the folder a reload reads, if any)."""
    ecfg = config.engine
    return Lifecycle(
        clients,
        staged=ecfg.staged,
        release_tags=ecfg.release_tags,
        reload_path=reload_path,
        settle_timeout=ecfg.settle_timeout,
        stage_timeout=ecfg.stage_timeout,
        liveness_timeout=ecfg.liveness_timeout,
        attach_state=ecfg.attach_state,
        takeover=ecfg.takeover,
        lease_timeout=ecfg.lease_timeout,
    )


def make_router(gate: Gate, config: RuntimeConfig, *, router_cls: type[Router] = Router, per_server: bool = True,
                sole_client: bool = False, clock: Callable[[], float] = time.monotonic) -> Router:
    """A router over `gate` from `scheduler.*` and `engine.request_timeout`. `per_server=False` leaves out
    the per-server limit (Ray's driver, whose router only binds trajectories; each worker enforces it).
    `sole_client`: no other router generates on these servers (a local runtime holding the owner lease),
    so a stop may abort everything on a server at once."""
    scfg = config.scheduler
    limit = scfg.per_server_concurrency if per_server else None
    if limit == "auto":  # resolved from the servers by Runtime.start (runtime/concurrency.py)
        raise ValueError("scheduler.per_server_concurrency 'auto' is resolved when a Runtime starts (from the servers' "
                         "/server_info); a router built without one needs a number or None")
    return router_cls(
        gate,
        per_server_limit=limit,
        slot_order=scfg.slot_order,
        server_priority=scfg.server_priority,
        max_retries=scfg.max_turn_retries,
        failure_threshold=scfg.server_failure_threshold,
        request_timeout=config.engine.request_timeout,
        sole_client=sole_client,
        clock=clock,
    )


def make_scheduler(
    router: Router,
    config: RuntimeConfig,
    *,
    tokenizer: Any,
    tools: Any = None,
    interaction: Any = None,
    reward_fn: Callable[..., Any] | None = None,
    clock: Callable[[], float] = time.monotonic,
    agents: Callable[[str], AgentLoop] | None = None,
) -> Scheduler:
    """A scheduler over `router` from `scheduler.*`, `agent.*` and `engine.hung_timeout` (the watchdog)."""
    return Scheduler(
        router,
        tokenizer=tokenizer,
        agent_config=config.agent,
        config=config.scheduler,
        tools=tools,
        interaction=interaction,
        default_agent=config.agent.agent,
        reward_fn=reward_fn,
        clock=clock,
        hung_timeout=config.engine.hung_timeout,
        agents=agents,
    )


def load_tools(config: RuntimeConfig) -> Any:
    """The tool registry of `agent.tools` (a bad file raises naming the line, before any engine starts)."""
    from ..tools.registry import ToolRegistry

    return ToolRegistry.load(config.agent.tools)


def on_teardown(stack: contextlib.AsyncExitStack, what: str, fn: Callable[[], Awaitable[Any]]) -> None:
    """Register `fn` on `stack`; a failure is logged (naming `what`) and the rest of the teardown goes on."""

    async def run() -> None:
        try:
            await fn()
        except Exception as e:  # the other parts must still be stopped
            log.error("%s failed: %s", what, e)

    stack.push_async_callback(run)


@dataclass
class RolloutParts:
    """What a rollout backend builds on, once the engines are asleep under the lifecycle."""

    config: RuntimeConfig  #: after `agent.max_context_tokens` was fitted to the engines
    lifecycle: Lifecycle
    clients: list[EngineClient]
    tokenizer: Any
    tools: Any
    interaction: Any
    reward_fn: Callable[..., Any] | None


class StepScheduler(Protocol):
    """What `Runtime` asks of a scheduler: `Scheduler`, or Ray's driver-side `RayScheduler`."""

    async def run(self, samples: Sequence[Sample], *, on_trajectory: Any = None, config: SchedulerConfig | None = None,
                  more_samples: Iterable[Sample] | None = None, watch_servers: bool = True) -> ScheduleResult: ...

    def server_watchdog(self) -> Any: ...

    def stop(self, reason: str = "stopped") -> None: ...

    async def aclose(self) -> None: ...


class RolloutBackend(Protocol):
    """Where the agent loops run. `open` comes before any engine starts, `build` after the lifecycle
    put them to sleep; each registers its teardown on `stack`."""

    async def open(self, stack: contextlib.AsyncExitStack) -> None: ...

    async def build(self, parts: RolloutParts, stack: contextlib.AsyncExitStack) -> tuple[Router, StepScheduler]: ...


class LocalRollout:
    """The agent loops run in this process: a router over the lifecycle's gate, a scheduler over it."""

    async def open(self, stack: contextlib.AsyncExitStack) -> None:
        return None

    async def build(self, parts: RolloutParts, stack: contextlib.AsyncExitStack) -> tuple[Router, Scheduler]:
        router = make_router(parts.lifecycle.gate, parts.config, sole_client=True)
        scheduler = make_scheduler(router, parts.config, tokenizer=parts.tokenizer, tools=parts.tools,
                                   interaction=parts.interaction, reward_fn=parts.reward_fn)
        on_teardown(stack, "closing the agent loops", scheduler.aclose)
        return router, scheduler
