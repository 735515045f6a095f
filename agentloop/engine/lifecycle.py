"""The engine lifecycle: a state machine and a gate over one or many engine servers.

States: SLEEPING → WEIGHTS_RESUMED → WEIGHTS_LOADED → AWAKE → DRAINING → SLEEPING.

`wake_up(weights)` (staged): resume(["weights"]) → load the new weights → resume(["kv_cache",
"cuda_graph"]) → AWAKE. One-stage mode resumes every released tag at once, then loads.
`sleep()`: DRAINING (gate closed: new generations wait) → pause(abort) in-flight requests → wait for
them to settle → continue_generation → flush_cache (retried while busy) → release every tag →
SLEEPING. The continue sits in the sleep, not the wake-up: a paused SGLang server holds new
requests until continued, so the engine is unpaused before it sleeps and wakes up ready to serve;
our own gate (closed from DRAINING until AWAKE) is what keeps generations out meanwhile.

This module is the only place that calls an engine's `generate` or `/health`: `Lifecycle.generate`
awaits the gate, so dispatching to an engine that is not AWAKE is impossible by construction (a
released SGLang server crashes on a generate or a `/health`). Every stage fans out to all engines
and is awaited as one; a stage that fails raises `LifecycleError` naming the stage and the server.
A failed wake-up stage leaves a state from which `wake_up` (resuming where it stopped) or `sleep`
is legal; a failed sleep stage leaves DRAINING, from which `sleep` resumes at the failed stage (a
wake-up must wait for that sleep to finish). Each engine's released tags are tracked so that
exactly the released ones are resumed or released.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

import anyio

from .base import MEMORY_TAGS, EngineClient, EngineError, GenerateOutput, SamplingParams
from .lifecycle_types import SLEEP_STAGES, EngineState, LifecycleError, StageRecord, Weights, same_weights

__all__ = ["SLEEP_STAGES", "EngineState", "Lifecycle", "LifecycleError", "StageRecord", "Weights"]

log = logging.getLogger(__name__)


@dataclass
class _Server:
    client: EngineClient
    released: set[str] = field(default_factory=set)
    in_flight: int = 0
    settled: anyio.Event = field(default_factory=anyio.Event)
    model_path: str | None = None


class Lifecycle:
    """State machine + gate over `clients`. Construct with the engines' present state.

    `staged=False` selects one-stage wake-up (for engines without memory tags). `reload_path` is the
    folder to reload when weights were released and no new weights are given (defaults to each
    server's `model_info()["model_path"]`). `on_generate` is an instrumentation hook called with
    (url, state) right before each dispatch.
    """

    def __init__(
        self,
        clients: Sequence[EngineClient],
        *,
        awake: bool = True,
        staged: bool = True,
        release_tags: Sequence[str] = MEMORY_TAGS,
        reload_path: str | None = None,
        flush_retries: int = 50,
        flush_retry_delay: float = 0.05,
        settle_timeout: float = 60.0,
        stage_timeout: float = 600.0,
        on_generate: Callable[[str, EngineState], None] | None = None,
    ) -> None:
        if not clients:
            raise ValueError("Lifecycle needs at least one engine client")
        self._servers: dict[str, _Server] = {c.url: self._server(c) for c in clients}
        self.staged = staged
        self.release_tags = tuple(release_tags)
        unknown = set(self.release_tags) - set(MEMORY_TAGS)
        if unknown:
            raise ValueError(f"unknown memory tags {sorted(unknown)}; known: {list(MEMORY_TAGS)}")
        self.reload_path = reload_path
        self.flush_retries = flush_retries
        self.flush_retry_delay = flush_retry_delay
        self.settle_timeout = settle_timeout
        self.stage_timeout = stage_timeout
        self.on_generate = on_generate
        self._state = EngineState.AWAKE if awake else EngineState.SLEEPING
        if not awake:
            for s in self._servers.values():
                s.released = set(self.release_tags)
        self._awake_event = anyio.Event()
        if awake:
            self._awake_event.set()
        self._transition_lock = anyio.Lock()
        self._last_weights: Weights | None = None
        self._waking: tuple[Weights | None, anyio.Event, list[BaseException]] | None = None
        self._sleep_resume_at: str | None = None
        self._version_counter = itertools.count(1)
        self.weight_version: str | None = None
        self.records: list[StageRecord] = []

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def urls(self) -> list[str]:
        return list(self._servers)

    @property
    def clients(self) -> list[EngineClient]:
        return [s.client for s in self._servers.values()]

    def in_flight(self, url: str | None = None) -> int:
        if url is not None:
            return self._servers[url].in_flight
        return sum(s.in_flight for s in self._servers.values())

    def _set_state(self, state: EngineState) -> None:
        log.debug("lifecycle %s -> %s", self._state.value, state.value)
        self._state = state
        if state is EngineState.AWAKE:
            self._awake_event.set()
        elif self._awake_event.is_set():
            self._awake_event = anyio.Event()

    def _server(self, client: EngineClient) -> _Server:
        """A server entry; a client that can tell (`SGLangClient.gate_open`) learns when the gate is open,
        so what it sends outside AWAKE is counted where the request leaves (`generations_outside_awake`)."""
        if hasattr(client, "gate_open"):
            client.gate_open = lambda: self._state is EngineState.AWAKE
        return _Server(client)

    @property
    def generations_outside_awake(self) -> int:
        """Generates and `/health` calls whose HTTP request left a client while the engines were not AWAKE
        (counted by the clients at the send, after the gate was passed; 0 for clients that cannot count)."""
        return sum(int(getattr(s.client, "sent_outside_awake", 0)) for s in self._servers.values())

    def remove_server(self, url: str) -> None:
        """Forget a dead server (the router calls this); its in-flight calls end on their own."""
        if len(self._servers) == 1 and url in self._servers:
            raise LifecycleError("remove_server", "cannot remove the last engine server", url=url)
        self._servers.pop(url, None)

    def add_server(self, client: EngineClient) -> None:
        """Add a server whose memory state matches the lifecycle's (awake only while AWAKE)."""
        s = self._server(client)
        if self._state is not EngineState.AWAKE:
            raise LifecycleError("add_server", f"servers can be added only while AWAKE, not {self._state.value}", url=client.url)
        self._servers[client.url] = s

    # ------------------------------------------------------------------ gate
    async def wait_awake(self, timeout: float | None = None) -> None:
        """Block until the engines are AWAKE (the gate)."""
        with anyio.fail_after(timeout) if timeout else contextlib.nullcontext():
            while self._state is not EngineState.AWAKE:
                await self._awake_event.wait()

    async def generate(
        self,
        url: str,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        rid: str | None = None,
        timeout: float | None = None,
        gate_timeout: float | None = None,
    ) -> GenerateOutput:
        """The one road to an engine's generate: waits for AWAKE, counts the request in flight."""
        server = self._servers.get(url)
        if server is None:
            raise EngineError("/generate", None, "server is not (or no longer) part of the lifecycle", url=url)
        while True:
            await self.wait_awake(gate_timeout)
            if self._state is EngineState.AWAKE:  # re-check: no await between this and the increment
                break
        if self.on_generate is not None:
            self.on_generate(url, self._state)
        server.in_flight += 1
        try:
            return await server.client.generate(input_ids, sampling_params, rid=rid, timeout=timeout)
        finally:
            server.in_flight -= 1
            if server.in_flight == 0:
                server.settled.set()

    async def health(self, url: str) -> bool:
        """Liveness without risk: `/health` (which generates) only while AWAKE, else `/model_info`."""
        server = self._servers[url]
        try:
            if self._state is EngineState.AWAKE:
                return await server.client.health()
            await server.client.model_info()
            return True
        except EngineError:
            return False

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Send an abort to every server directly (routers do not forward aborts)."""
        await self._fan_out("abort", lambda s: s.client.abort_request(rid, abort_all=abort_all))

    # ------------------------------------------------------------------ transitions
    async def wake_up(self, weights: "Weights | Mapping[str, Any] | str | Path | None" = None) -> str | None:
        """Staged wake-up; returns the weight version now served.

        "The same weights" means the same state dict object or the same path (see `_same_weights`),
        not the same `Weights` wrapper. Callers that arrive while a wake-up with the same weights
        (or with none) is running share it (and its error). While AWAKE, a call without weights,
        with the same weights as the last load, or with the version already served is a no-op.
        Different weights while AWAKE (another state dict, another path, a new `version`) are loaded
        in place with a new version and logged, never dropped: this is how a trainer pushes weights
        without a sleep. To reload a path or a dict changed in place while AWAKE, give a new version.
        """
        w = Weights.coerce(weights)
        joining = self._waking
        if joining is not None and (w is None or same_weights(w, joining[0])):
            await joining[1].wait()
            if joining[2]:
                raise joining[2][0]
            return self.weight_version
        async with self._transition_lock:
            if self._state is EngineState.AWAKE:
                already = w is None or same_weights(w, self._last_weights) or (
                    w.version is not None and w.version == self.weight_version)
                if w is not None and not already:
                    version = self._next_version(w)
                    log.info("wake_up while AWAKE with new weights: loading them in place (%s -> %s)",
                             self.weight_version, version)
                    await self._stage("wake_up", "update_weights", lambda s: self._load(s, w, version))
                    self._last_weights = w
                return self.weight_version
            if self._state is EngineState.DRAINING:
                # the lock is free, so no sleep is running: the last one failed part-way
                raise LifecycleError(
                    "wake_up", f"the last sleep failed at stage '{self._sleep_resume_at}' and the "
                    "engines are DRAINING; call sleep() to finish it, then wake_up")
            self._waking = (w, anyio.Event(), [])
            try:
                await self._wake_stages(w)
                self._last_weights = w
            except BaseException as e:
                self._waking[2].append(e)
                raise
            finally:
                self._waking[1].set()
                self._waking = None
            return self.weight_version

    async def _wake_stages(self, w: Weights | None) -> None:
        if self.staged:
            if self._state is EngineState.SLEEPING:
                await self._stage("wake_up", "resume_weights", lambda s: self._resume(s, ["weights"]))
                self._set_state(EngineState.WEIGHTS_RESUMED)
            if self._state is EngineState.WEIGHTS_RESUMED:
                await self._load_weights(w)
                self._set_state(EngineState.WEIGHTS_LOADED)
            await self._stage("wake_up", "resume_kv_cache", lambda s: self._resume(s, [t for t in MEMORY_TAGS if t != "weights"]))
        else:
            await self._stage("wake_up", "resume_all", lambda s: self._resume(s, list(MEMORY_TAGS)))
            self._set_state(EngineState.WEIGHTS_RESUMED)
            await self._load_weights(w)
            self._set_state(EngineState.WEIGHTS_LOADED)
        self._set_state(EngineState.AWAKE)

    async def sleep(self) -> None:
        """Close the gate, abort and settle in-flight requests, flush, release every tag.

        From AWAKE every stage runs. After a failed sleep (state DRAINING) a retry resumes at the
        stage that failed, like a retried wake-up: a failed flush_cache is flushed again before the
        release, a failed release is only released again (each server's released tags are tracked,
        so nothing is released twice). From a wake-up that stopped part-way nothing was generated,
        so only the release runs.
        """
        async with self._transition_lock:
            if self._state is EngineState.SLEEPING:
                return
            if self._state is EngineState.AWAKE:
                first = SLEEP_STAGES[0]
            elif self._state is EngineState.DRAINING:
                first = self._sleep_resume_at or SLEEP_STAGES[0]
            else:
                first = "release"
            self._set_state(EngineState.DRAINING)
            run: dict[str, Callable[[_Server], Awaitable[Any]]] = {
                "pause": lambda s: s.client.pause_generation("abort"),
                "settle": self._settle,
                # the engine is not left paused while asleep, so a wake-up needs no continue
                "continue": lambda s: s.client.continue_generation(),
                "flush_cache": self._flush,
                "release": self._release,
            }
            for stage in SLEEP_STAGES[SLEEP_STAGES.index(first):]:
                # set before the stage runs, so an error or a cancellation leaves it pointing here
                self._sleep_resume_at = stage
                await self._stage("sleep", stage, run[stage])
            self._sleep_resume_at = None
            self._set_state(EngineState.SLEEPING)

    @property
    def sleep_resume_at(self) -> str | None:
        """The sleep stage a retried `sleep()` starts at (None unless a sleep failed part-way)."""
        return self._sleep_resume_at

    # ------------------------------------------------------------------ stages
    def _next_version(self, w: Weights) -> str:
        return w.version or f"v{next(self._version_counter)}"

    async def _load_weights(self, w: Weights | None) -> None:
        if w is None:
            # Released weights have lost their values (SGLang zeroes them): reload from disk.
            if "weights" in self.release_tags:
                await self._stage("wake_up", "update_weights", self._reload)
            return
        version = self._next_version(w)
        await self._stage("wake_up", "update_weights", lambda s: self._load(s, w, version))

    async def _reload(self, s: _Server) -> None:
        path = self.reload_path or s.model_path
        if path is None:
            info = await s.client.model_info()
            path = s.model_path = info.get("model_path")
        if not path:
            raise LifecycleError(
                "update_weights", "weights were released and no new weights were given, and the server "
                "reports no model_path to reload from; pass weights= to wake_up", url=s.client.url)
        version = self.weight_version or "default"
        await s.client.update_weights_from_disk(path, weight_version=version, flush_cache=True)
        self.weight_version = version

    async def _load(self, s: _Server, w: Weights, version: str) -> None:
        if w.state_dict is not None:
            await s.client.update_weights_from_tensor(
                list(w.state_dict.items()), load_format=w.load_format, weight_version=version, flush_cache=True)
        elif w.path is not None:
            await s.client.update_weights_from_disk(w.path, load_format=w.load_format, weight_version=version, flush_cache=True)
        else:
            raise LifecycleError("update_weights", "Weights has neither a state_dict nor a path", url=s.client.url)
        self.weight_version = version

    async def _resume(self, s: _Server, tags: Sequence[str]) -> None:
        todo = [t for t in tags if t in s.released]
        if todo:
            await s.client.resume_memory_occupation(todo)
            s.released.difference_update(todo)

    async def _release(self, s: _Server) -> None:
        todo = [t for t in self.release_tags if t not in s.released]
        if todo:
            await s.client.release_memory_occupation(todo)
            s.released.update(todo)

    async def _settle(self, s: _Server) -> None:
        with anyio.fail_after(self.settle_timeout):
            while s.in_flight > 0:
                s.settled = anyio.Event()
                await s.settled.wait()

    async def _flush(self, s: _Server) -> None:
        for _ in range(self.flush_retries):
            if await s.client.flush_cache():
                return
            await anyio.sleep(self.flush_retry_delay)
        raise LifecycleError("flush_cache", f"engine still busy after {self.flush_retries} tries", url=s.client.url)

    async def _stage(self, phase: str, stage: str, fn: Callable[[_Server], Awaitable[Any]]) -> None:
        start = time.monotonic()
        await self._fan_out(stage, fn)
        self.records.append(StageRecord(phase, stage, start, time.monotonic(), {"servers": len(self._servers)}))

    async def _fan_out(self, stage: str, fn: Callable[[_Server], Awaitable[Any]]) -> None:
        errors: list[LifecycleError] = []

        async def one(s: _Server) -> None:
            try:
                with anyio.fail_after(self.stage_timeout):
                    await fn(s)
            except LifecycleError as e:
                errors.append(e)
            except (EngineError, TimeoutError, OSError) as e:
                errors.append(LifecycleError(stage, str(e), url=s.client.url, cause=e))

        async with anyio.create_task_group() as tg:
            for s in list(self._servers.values()):
                tg.start_soon(one, s)
        if errors:
            raise errors[0]
