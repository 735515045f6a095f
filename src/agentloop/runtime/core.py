"""`Runtime`: the trainer-facing API. One step = staged wake-up → roll out → collate → sleep.

This module owns the engines' lifetime and the step sequence, nothing else:

- **Engines**: the embedded CPU engine by default, URLs of running SGLang servers, servers launched
  through `agentloop.engine.launch`, or `EngineClient` objects handed in. *How* each is obtained
  (processes, clients, tokenizer, the engines' context length) is `agentloop.engine_setup`; this
  module picks the mode, owns what was started, and puts one `Lifecycle` over all of them.
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
from .engines import (
    embedded_model,
    fit_context_to_engines,
    launch_sglang,
    load_tokenizer,
    make_client,
    start_embedded,
)
from .inputs import check_pad_to, check_reward_name, rows_to_samples
from .concurrency import ConcurrencyInfo, resolve_concurrency
from .metrics import step_metrics
from .sync import SyncFacade
from .types import (
    AgentloopError,
    StepCollateError,
    StepError,
    StepResult,
    StepSleepError,
    StepStream,
)
from ..scheduler.core import ScheduleResult, Scheduler, with_overrides
from ..types import Sample, Trajectory, training_rows

log = logging.getLogger(__name__)

__all__ = ["AgentloopError", "Runtime", "StepCollateError", "StepError", "StepResult", "StepSleepError", "StepStream"]

OnTrajectory = Callable[[Trajectory], "Awaitable[None] | None"]


class Runtime(SyncFacade):
    """Owns or attaches engines and runs steps. Use as `async with Runtime(cfg) as rt: await rt.step(...)`
    or, from synchronous code, `with Runtime(cfg) as rt: rt.step_sync(...)`."""

    #: Whether this class honours `config.ray` (RayRuntime); a plain Runtime refuses a Ray config.
    runs_on_ray = False

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
    ) -> None:
        self.config = config if isinstance(config, RuntimeConfig) else RuntimeConfig.model_validate(config or {})
        if self.config.ray.enabled and not self.runs_on_ray:
            raise ValueError("config ray.enabled is true but Runtime runs in this process: use "
                             "agentloop.distributed.RayRuntime (same arguments, same step) for Ray mode")
        self._given_clients = list(clients) if clients is not None else None
        self.tokenizer = tokenizer
        self.tools = tools
        self.interaction = interaction
        self.reward_fn = reward_fn
        self.on_trajectory = on_trajectory
        self.lifecycle: Lifecycle | None = None
        self.router: Router | None = None
        self.scheduler: Scheduler | None = None
        self.clients: list[EngineClient] = []
        self.processes: list[Any] = []  #: embedded engine processes / launched servers we own
        self.model_path: str | None = None
        self.steps_done = 0
        self._row_numbers = itertools.count(1)  #: numbers the uids generated for dict rows given to `step`
        #: Smallest usable context (prompt + response) the engines reported at start (None: none reported).
        self.engine_context_length: int | None = None
        #: What scheduler.concurrency resolved to at start, and why (`agentloop.runtime.concurrency`).
        self.concurrency: ConcurrencyInfo | None = None
        self._step_lock = anyio.Lock()

    # ------------------------------------------------------------------ start / stop
    @property
    def started(self) -> bool:
        return self.scheduler is not None

    async def start(self) -> "Runtime":
        """Start or attach engines, load the tokenizer and tools, put the engines to sleep."""
        if self.started:
            return self
        ecfg = self.config.engine
        if self.tools is None:  # a bad tools file is refused before any engine starts
            self.tools = self._load_tools()
        tt = self.config.scheduler.trajectory_timeout
        if tt is not None and ecfg.request_timeout >= tt:
            log.warning("engine.request_timeout (%gs) >= scheduler.trajectory_timeout (%gs): a request stuck on a bad "
                        "server times out only with its trajectory, leaving no time to retry it elsewhere (only the "
                        "engine.hung_timeout watchdog can fail over); keep request_timeout well under it", ecfg.request_timeout, tt)
        try:
            if self._given_clients is not None:
                self.clients = list(self._given_clients)
            elif ecfg.mode == "urls":
                self.clients = [self._client(u) for u in ecfg.urls]
            elif ecfg.mode == "launch":
                await self._launch()
            else:
                await self._start_embedded()
            self.tokenizer = self.tokenizer if self.tokenizer is not None else await self._load_tokenizer()
            await self._fit_context_to_engines()
            # `scheduler.concurrency: auto` becomes a number from what the engines can run.
            self.config, self.concurrency = await resolve_concurrency(self.config, self.clients)
            self.lifecycle = Lifecycle(
                self.clients,
                staged=ecfg.staged,
                release_tags=ecfg.release_tags,
                reload_path=self.model_path,
                settle_timeout=ecfg.settle_timeout,
                stage_timeout=ecfg.stage_timeout,
                liveness_timeout=ecfg.liveness_timeout,
                attach_state=ecfg.attach_state,
                takeover=ecfg.takeover,
                lease_timeout=ecfg.lease_timeout,
            )
            await self.lifecycle.attach()  # each server's real memory state, before any lifecycle call
            await self.lifecycle.sleep()
            await self._build_scheduler()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            raise
        return self

    async def _build_scheduler(self) -> None:
        """The router over the lifecycle's gate and the scheduler over the router (RayRuntime's differ)."""
        assert self.lifecycle is not None
        scfg, ecfg = self.config.scheduler, self.config.engine
        self.router = Router(
            self.lifecycle.gate,
            per_server_limit=scfg.per_server_concurrency,
            slot_order=scfg.slot_order,
            max_retries=scfg.max_turn_retries,
            failure_threshold=scfg.server_failure_threshold,
            request_timeout=ecfg.request_timeout,
        )
        self.scheduler = Scheduler(
            self.router,
            tokenizer=self.tokenizer,
            agent_config=self.config.agent,
            config=scfg,
            tools=self.tools,
            interaction=self.interaction,
            default_agent=self.config.agent.agent,
            reward_fn=self.reward_fn,
            hung_timeout=ecfg.hung_timeout,
        )

    @property
    def attached(self) -> bool:
        """Whether the engines are servers this runtime attached to (URLs or clients given), not its own."""
        return not self.processes

    async def stop(self) -> None:
        """Leave servers attached to as they were found (`engine.restore_on_stop`), stop what we started."""
        with anyio.CancelScope(shield=True):
            await self._shutdown()

    async def _shutdown(self) -> None:
        if self.scheduler is not None:
            try:
                await self.scheduler.aclose()
            except Exception as e:  # the engines must still be stopped
                log.error("closing the agent loops failed: %s", e)
        lc = self.lifecycle
        if lc is not None and self.attached:
            try:
                await (lc.restore() if self.config.engine.restore_on_stop else lc.park())
            except Exception as e:  # say it, and stop anyway: the servers' marks say what state they are in
                log.error("could not leave the engine servers as they were found: %s", e)
        if lc is not None:
            lc.close()  # its lease, wherever left, is a dead owner's from now on
        for c in self.clients:
            with contextlib.suppress(Exception):
                await c.close()
        for p in reversed(self.processes):
            try:
                with anyio.fail_after(60):
                    await p.stop()
            except Exception as e:  # keep stopping the others; say which one failed
                log.error("stopping engine %r failed: %s", getattr(p, "url", p), e)
        self.processes.clear()
        self.scheduler = None

    async def __aenter__(self) -> "Runtime":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # Engine provisioning lives in `agentloop.engine_setup`; these thin methods are what RayRuntime
    # overrides (`_start_embedded`, `_launch`) or calls (`_client`, `_embedded_model`).
    def _client(self, url: str) -> EngineClient:
        return make_client(url, self.config.engine)

    def _embedded_model(self) -> Path:
        """The embedded engine's model folder (`engine.model`, else the shipped tiny tool model)."""
        model = embedded_model(self.config.engine)
        self.model_path = str(model)
        return model

    async def _start_embedded(self) -> None:
        model = self._embedded_model()
        urls = await start_embedded(self.config.engine, model, self.processes)
        self.clients = [self._client(u) for u in urls]

    async def _launch(self) -> None:
        lc = self.config.engine.launch
        assert lc is not None
        self.model_path = lc.model_path
        urls = await launch_sglang(self.config.engine, self.processes)
        self.clients = [self._client(u) for u in urls]

    async def _load_tokenizer(self) -> Any:
        return await load_tokenizer(self.config.engine, self.model_path, self.clients)

    async def _fit_context_to_engines(self) -> None:
        """Lower `agent.max_context_tokens` to the engines' usable context (`fit_context_to_engines`)."""
        self.config, self.engine_context_length = await fit_context_to_engines(self.config, self.clients)

    def _load_tools(self) -> Any:
        from ..tools.registry import ToolRegistry

        return ToolRegistry.load(self.config.agent.tools)

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
            first_record, first_event = len(lc.records), len(lc.server_events)
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
                records=lc.records[first_record:], server_events=lc.server_events[first_event:],
                generations_outside_awake=lc.generations_outside_awake, out_of_rotation=lc.out_of_rotation)
            return StepResult(
                step=self.steps_done, weight_version=version, trajectories=rows, batch=batch,
                carry_over=result.carry_over, metrics=metrics, rejected=result.rejected,
            )

    @contextlib.asynccontextmanager
    async def stream(
        self, samples: Sequence[Sample | Mapping[str, Any]], weights: Any = None, **kwargs: Any
    ) -> AsyncIterator["StepStream"]:
        """The async-iterator form of `step`: finished trajectories as they come, then the `StepResult`.

            async with rt.stream(samples, weights) as s:
                async for traj in s:
                    ...            # write it out, show progress
            result = s.result

        It runs the same `step` coroutine (its `on_trajectory` feeds the iterator)."""
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
