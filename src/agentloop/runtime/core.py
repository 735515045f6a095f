"""`Runtime`: the trainer-facing API. One step = staged wake-up → roll out → collate → sleep.

This module owns the engines' lifetime and the step sequence, nothing else:

- **Engines**: the embedded CPU engine by default, URLs of running SGLang servers, servers launched
  through `agentloop.engine.launch`, or `EngineClient` objects handed in: an `EngineBackend`
  strategy chosen from config (`runtime.backends`; Ray's fleet of engine actors is one more). The
  lifecycle, router and scheduler are built from config by `runtime.assembly`; where the agent loops
  run is the other strategy, a `RolloutBackend` (`LocalRollout`, or Ray's workers). This module puts
  one `Lifecycle` over the engines and runs the steps; every part registers its teardown as it starts.
  At `start()` the lifecycle first learns each server's real memory state (`Lifecycle.attach`: a
  server another run left asleep is never released twice), then the engines are put to sleep, so
  every step begins SLEEPING and wakes in stages (a trainer colocated on the GPU needs that memory
  between steps). `stop()` leaves servers it attached to by URL in the state it found them
  (`Lifecycle.restore`, `engine.restore_on_stop`) and stops the ones it started.
- **Per-runtime state built once**: tokenizer (the model folder, a configured path, or the servers'
  `model_info()["tokenizer_path"]`), tool registry, router, scheduler; the agents' context budget
  (`agent.max_context_tokens`) lowered to the smallest context length the engines report.
- **`await step(samples, weights)`**: `lifecycle.wake_up(weights)` (a state dict, a path, or None =
  reload) → `Scheduler.run` → `collate` → `lifecycle.sleep()` (also on error or cancellation).
  Returns a `StepResult`: trajectories, the tensor batch, carry-over samples for the next step,
  metrics (tokens/s, counts by status, seconds of every wake/sleep stage) and the weight version.
- **`step_sync(...)`**: the same coroutine through an anyio blocking portal (one event loop for the
  runtime's whole life, since HTTP sessions and subprocesses belong to it): `runtime_sync.SyncFacade`.
  No second implementation.

A step's arguments are checked before any engine wakes (`runtime_inputs`); its metrics are assembled
by `runtime_metrics.step_metrics`; what it returns is `runtime_types`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence

import anyio

from ..batch import CollateError, collate
from ..config.settings import RuntimeConfig
from ..engine.base import EngineClient
from ..engine.lifecycle import EngineState, Lifecycle, Weights
from ..engine.router import Router
from .assembly import LocalRollout, RolloutBackend, RolloutParts, StepScheduler, load_tools, make_lifecycle
from .backends import EngineBackend, engine_backend
from .engines import fit_context_to_engines, load_tokenizer
from .inputs import check_pad_to, check_reward_name, rows_to_samples
from .concurrency import ConcurrencyInfo, resolve_concurrency
from .metrics import step_metrics
from .stream import StreamConfig, rollout_stream
from .sync import SyncFacade
from .types import (
    AgentloopError,
    StepCollateError,
    StepError,
    StepResult,
    StepSleepError,
    StepStream,
    StreamBlock,
)
from ..scheduler.core import ScheduleResult, with_overrides
from ..types import Sample, Trajectory, training_rows

log = logging.getLogger(__name__)

__all__ = ["AgentloopError", "Runtime", "StepCollateError", "StepError", "StepResult", "StepSleepError", "StepStream"]

OnTrajectory = Callable[[Trajectory], "Awaitable[None] | None"]


class Runtime(SyncFacade):
    """Owns or attaches engines and runs steps. Use as `async with Runtime(cfg) as rt: await rt.step(...)`
    or, from synchronous code, `with Runtime(cfg) as rt: rt.step_sync(...)`.

    What it is built from are two strategy objects, both chosen from the config unless given:
    `engines` (where the engines come from: `runtime.backends.engine_backend(config, clients)`) and
    `rollout` (where the agent loops run: `LocalRollout`, this process). `RayRuntime` is this class
    given its Ray strategies; a Ray config (`ray.enabled`) without them is refused."""

    def __init__(
        self,
        config: RuntimeConfig | Mapping[str, Any] | None = None,
        *,
        clients: Sequence[EngineClient] | None = None,
        tokenizer: Any = None,
        tools: Any = None,
        interaction: Any = None,
        reward_fn: Callable[..., Awaitable[Any]] | None = None,
        on_trajectory: OnTrajectory | None = None,
        engines: EngineBackend | None = None,
        rollout: RolloutBackend | None = None,
    ) -> None:
        self.config = config if isinstance(config, RuntimeConfig) else RuntimeConfig.model_validate(config or {})
        if self.config.ray.enabled and rollout is None:
            raise ValueError("config ray.enabled is true but Runtime runs in this process: use "
                             "agentloop.distributed.RayRuntime (same arguments, same step) for Ray mode")
        self.engines: EngineBackend = engines if engines is not None else engine_backend(self.config, clients)
        self.rollout: RolloutBackend = rollout if rollout is not None else LocalRollout()
        self.tokenizer = tokenizer
        self.tools = tools
        self.interaction = interaction
        self.reward_fn = reward_fn
        self.on_trajectory = on_trajectory
        self.lifecycle: Lifecycle | None = None
        self.router: Router | None = None
        self.scheduler: StepScheduler | None = None
        self.clients: list[EngineClient] = []
        self.model_path: str | None = None
        self.steps_done = 0
        self._row_numbers = itertools.count(1)  #: numbers the uids generated for dict rows given to `step`
        #: Smallest usable context (prompt + response) the engines reported at start (None: none reported).
        self.engine_context_length: int | None = None
        #: What scheduler.concurrency resolved to at start, and why (`agentloop.runtime.concurrency`).
        self.concurrency: ConcurrencyInfo | None = None
        self._step_lock = anyio.Lock()
        #: What `start` started, each part's teardown registered as it started (run in reverse by `stop`).
        self._teardown: contextlib.AsyncExitStack | None = None

    # ------------------------------------------------------------------ start / stop
    @property
    def started(self) -> bool:
        return self.scheduler is not None

    @property
    def processes(self) -> list[Any]:
        """The engine processes (or Ray fleet) this runtime started and will stop; empty when attached."""
        return self.engines.processes

    async def start(self) -> "Runtime":
        """Start or attach engines, load the tokenizer and tools, put the engines to sleep."""
        if self.started:
            return self
        ecfg = self.config.engine
        if self.tools is None:  # a bad tools file is refused before any engine starts
            self.tools = load_tools(self.config)
        tt = self.config.scheduler.trajectory_timeout
        if tt is not None and ecfg.request_timeout >= tt:
            log.warning("engine.request_timeout (%gs) >= scheduler.trajectory_timeout (%gs): a request stuck on a bad "
                        "server times out only with its trajectory, leaving no time to retry it elsewhere (only the "
                        "engine.hung_timeout watchdog can fail over); keep request_timeout well under it", ecfg.request_timeout, tt)
        stack = self._teardown = contextlib.AsyncExitStack()
        try:
            await self.rollout.open(stack)
            self.clients = await self.engines.start(stack)
            self.model_path = self.engines.model_path
            if self.tokenizer is None:
                self.tokenizer = await load_tokenizer(ecfg, self.model_path, self.clients)
            # Lower agent.max_context_tokens to the engines' usable context (a copy of the config).
            self.config, self.engine_context_length = await fit_context_to_engines(self.config, self.clients)
            # `scheduler.concurrency: auto` becomes a number from what the engines can run.
            self.config, self.concurrency = await resolve_concurrency(self.config, self.clients)
            lc = self.lifecycle = make_lifecycle(self.clients, self.config, self.model_path)
            stack.push_async_callback(self._leave_engines, lc)
            await lc.attach()  # each server's real memory state, before any lifecycle call
            await lc.sleep()
            parts = RolloutParts(config=self.config, lifecycle=lc, clients=self.clients, tokenizer=self.tokenizer,
                                 tools=self.tools, interaction=self.interaction, reward_fn=self.reward_fn)
            self.router, self.scheduler = await self.rollout.build(parts, stack)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            raise
        return self

    async def _leave_engines(self, lc: Lifecycle) -> None:
        """Leave servers attached to as they were found (`engine.restore_on_stop`), then let go of the lifecycle."""
        if self.attached:
            try:
                await (lc.restore() if self.config.engine.restore_on_stop else lc.park())
            except Exception as e:  # say it, and stop anyway: the servers' marks say what state they are in
                log.error("could not leave the engine servers as they were found: %s", e)
        lc.close()  # its lease, wherever left, is a dead owner's from now on

    @property
    def attached(self) -> bool:
        """Whether the engines are servers this runtime attached to (URLs or clients given), not its own."""
        return not self.processes

    async def stop(self) -> None:
        """Leave servers attached to as they were found (`engine.restore_on_stop`), stop what we started."""
        with anyio.CancelScope(shield=True):
            await self._shutdown()

    async def _shutdown(self) -> None:
        stack, self._teardown = self._teardown, None
        self.scheduler = None
        if stack is not None:
            await stack.aclose()

    async def __aenter__(self) -> "Runtime":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ the step
    async def step(
        self,
        samples: Sequence[Sample | Mapping[str, Any]],
        weights: "Weights | Mapping[str, Any] | str | Path | None" = None,
        *,
        on_trajectory: OnTrajectory | None = None,
        pad_to: tuple[int | None, int | None] | None = None,
        more_samples: Iterable[Sample] | None = None,
        **overrides: Any,
    ) -> StepResult:
        """Wake the engines with `weights` (staged), run every sample's agent loop, collate, sleep.

        `samples` are `Sample`s or dataset-style rows (dicts, as in a JSONL file: `{"prompt": ...,
        "ground_truth": ...}`, see `agentloop.dataset`), converted by `dataset.row_to_sample` (uid
        `row-<k>` when the row has none); a bad row raises ValueError naming its index, before waking.

        `overrides` replace scheduler settings for this step (e.g. `n=4`, `target_groups=8`).
        `pad_to=(prompt_len, response_len)` pads the batch to fixed lengths (either None = the batch's
        longest); a trajectory longer than that raises `StepCollateError`, which keeps the step's results.
        `more_samples` (an iterator of fresh `Sample`s) feeds the group filter's over-sampling: with
        `group_filter` and `target_groups`, prompts are drawn from it while rejected groups keep the
        step short of the target (see `agentloop.scheduler`); rejected groups are on `StepResult.rejected`.
        """
        pad_to = check_pad_to(pad_to)
        samples = rows_to_samples(samples, self._row_numbers, trainer_reward=self.reward_fn is not None)
        if not self.started:
            await self.start()
        assert self.lifecycle is not None and self.scheduler is not None
        cfg = with_overrides(self.config.scheduler, overrides)
        if self.reward_fn is None:
            check_reward_name(cfg.reward)
        async with self._step_lock:
            lc = self.lifecycle
            first_record, first_event = lc.record_mark(), len(lc.server_events)
            t0 = time.monotonic()
            version: str | None = None
            result: ScheduleResult | None = None
            if lc.state is EngineState.DRAINING:
                # The last step's sleep failed part-way: finish it (from the failed stage) so this
                # step wakes from a clean SLEEPING state; if it fails again, nothing was woken.
                log.warning("finishing the previous step's sleep (failed at stage %r) before waking", lc.sleep_resume_at)
                await lc.sleep()
            try:
                version = await lc.wake_up(weights)
                t_awake = time.monotonic()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lc.keep_lease)  # a rollout longer than half the lease keeps it
                    result = await self.scheduler.run(samples, config=cfg, on_trajectory=on_trajectory or self.on_trajectory,
                                                      more_samples=more_samples)
                    tg.cancel_scope.cancel()
            finally:
                t_rolled = time.monotonic()
                with anyio.CancelScope(shield=True):
                    try:
                        await lc.sleep()
                    except Exception as e:
                        if result is None:
                            raise  # the rollout itself failed or was cancelled: nothing to hand back
                        raise StepSleepError(
                            f"step {self.steps_done + 1}: the rollout finished but the engines' sleep failed: {e} (the "
                            "step's trajectories and carry-over are on this exception; the next step finishes the "
                            "sleep before waking)", result.trajectories, result.carry_over) from e
            t_end = time.monotonic()
            assert result is not None
            rows = training_rows(result.trajectories)  # a split trajectory is one row per segment
            try:
                batch = collate(rows, pad_token_id=self.pad_token_id, pad_to=pad_to)
            except CollateError as e:
                raise StepCollateError(f"step {self.steps_done + 1}: {e} (the step's trajectories and carry-over are on "
                                       "this exception)", result.trajectories, result.carry_over) from e
            self.steps_done += 1
            metrics = step_metrics(
                result.metrics, step=self.steps_done, weight_version=version, times=(t0, t_awake, t_rolled, t_end),
                records=lc.records_since(first_record), server_events=lc.server_events[first_event:],
                generations_outside_awake=lc.generations_outside_awake, out_of_rotation=lc.out_of_rotation)
            return StepResult(
                step=self.steps_done, weight_version=version, trajectories=rows, batch=batch,
                carry_over=result.carry_over, metrics=metrics, rejected=result.rejected,
            )

    def stream(self, samples: Any, *args: Any, **kwargs: Any) -> "StreamBlock":
        """Two streams, both `async with` blocks:

        - **one step's trajectories** (`rt.stream(samples, weights, **step_kwargs)`): finished
          trajectories as they come, then the `StepResult` on `s.result`. It runs the same `step`
          coroutine (its `on_trajectory` feeds the iterator).

              async with rt.stream(samples, weights) as s:
                  async for traj in s:
                      ...            # write it out, show progress
              result = s.result

        - **the streaming mode** (`rt.stream(feeder, StreamConfig(...), weights=None, **overrides)`, or
          `config=StreamConfig(...)`): `runtime.stream.rollout_stream` — the engine stays awake, complete
          groups come as `StreamBatch`es, weights are applied in flight:

              async with rt.stream(prompts, StreamConfig(batch_groups=8, active=256, max_staleness=1)) as s:
                  async for batch in s:
                      await s.update_weights(train_on(batch))
        """
        config = kwargs.pop("config", None)
        if config is None and args and isinstance(args[0], StreamConfig):
            config, args = args[0], args[1:]
        if config is not None:
            if args:
                raise TypeError("rt.stream(feeder, StreamConfig(...)) takes its weights as weights=..., "
                                f"not positionally (got {len(args)} more positional argument(s))")
            return StreamBlock(rollout_stream(self, samples, config, **kwargs), "rt.stream(feeder, config)")
        return StreamBlock(self._step_stream(samples, *args, **kwargs), "rt.stream(samples, weights)")

    @contextlib.asynccontextmanager
    async def _step_stream(
        self, samples: Sequence[Sample | Mapping[str, Any]], weights: Any = None, **kwargs: Any
    ) -> AsyncIterator["StepStream"]:
        send, receive = anyio.create_memory_object_stream[Trajectory](math.inf)
        out = StepStream(receive)
        user_cb = kwargs.pop("on_trajectory", None) or self.on_trajectory

        async def feed(traj: Trajectory) -> None:
            if user_cb is not None:
                r = user_cb(traj)
                if r is not None:
                    await r
            send.send_nowait(traj)

        async def run() -> None:
            with send:
                out.result = await self.step(samples, weights, on_trajectory=feed, **kwargs)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            try:
                yield out
            finally:
                receive.close()

    async def sleep(self) -> None:
        """Sleep now, even in the middle of a step: running trajectories are stopped (carried over),
        in-flight requests aborted and settled, then memory is released."""
        if self.scheduler is not None:
            self.scheduler.stop("runtime sleep requested")
        if self.lifecycle is not None:
            await self.lifecycle.sleep()

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        for name in ("pad_token_id", "eos_token_id"):
            v = getattr(tok, name, None)
            if isinstance(v, int):
                return v
        return 0

    @property
    def weight_version(self) -> str | None:
        return self.lifecycle.weight_version if self.lifecycle else None
