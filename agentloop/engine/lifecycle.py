"""The engine lifecycle: the state machine that drives engine servers' memory through wake and sleep,
and opens and closes the gates it owns.

States: SLEEPING → WEIGHTS_RESUMED → WEIGHTS_LOADED → AWAKE → DRAINING → SLEEPING.

`wake_up(weights)` (staged): liveness probe → resume(["weights"]) → load the new weights →
resume(["kv_cache", "cuda_graph"]) → AWAKE → open every gate. One-stage mode resumes every released
tag at once, then loads. `sleep()`: DRAINING → close every gate → liveness probe → pause(abort)
in-flight requests → wait for them to settle (in every gate) → continue_generation → flush_cache
(retried while busy) → release every tag → SLEEPING. The continue sits in the sleep, not the
wake-up: a paused SGLang server holds new requests until continued, so the engine is unpaused
before it sleeps and wakes up ready to serve; the gates (closed from DRAINING until AWAKE) keep
generations out meanwhile.

**Gates.** Generation never goes through this class's own code: `agentloop.engine.gate.Gate` is the
only road to an engine's generate and `/health`. A `Lifecycle` owns a local `Gate` (`.gate`, the
one its process's router uses) and any number of other `GateControl`s added with `add_gates` (Ray
mode: the `WorkerPool`, which moves every worker's gate at once); every transition moves all of them
the same way, so no subclass re-implements `wake_up` or `sleep`.

**Servers in and out of rotation.** Every stage fans out to the servers in rotation and is awaited
as one. A server that fails a stage, the liveness probe (`/model_info`, never a generate, within
`liveness_timeout`) or, mid-step, the router or the step watchdog, is taken out (`take_out`: one
log line, every gate told) while the others go on; only when no server is left does a stage fail,
with a `LifecycleError` naming each server and why. Before each wake-up the servers out of rotation
are probed too: one that answers (restarted, or no longer hung) is re-admitted in the memory state it
really is in (below), put to sleep like the others, and woken with the step's weights.
A stage failing on every server leaves a state from which `wake_up` (resuming where it stopped) or
`sleep` is legal; a failed sleep stage leaves DRAINING, from which `sleep` resumes at the failed stage.

**Attach state: knowing each server's memory before the first call.** SGLang 0.5.17 does not report
its released memory tags over HTTP, and it crashes on a release of released memory ("Cannot pause
allocation that is not active") and on a resume of resident memory (KeyError in its scheduler). So:

1. The lifecycle *records* each server's memory state in the server itself: around every release and
   resume it writes a `MemoryMark` into the server's weight version (`/update_weight_version`, which
   only sets a string in SGLang's HTTP process and is safe in any memory state; weight loads carry
   the mark as their `weight_version`). "pending" names a memory call sent and not yet answered. The
   mark dies with the server process, so a restarted server never carries a stale one; once fully
   awake the server reports its plain weight version again.
2. `attach()` (called by `Runtime.start`, and for every re-admitted server) reads `/model_info`:
   no mark = nothing released (a fresh server, or one left awake); a mark = exactly its tags. A mark
   with a pending call (a runtime killed while that call was on the wire) is resolved by the server's
   own report if it has one (the CPU engine's `/server_info` lists `released_tags`); otherwise the
   server is refused with a message that says what to do: restart it, or set `engine.attach_state`.
3. `engine.attach_state` (`awake` | `asleep`) overrides the probe at attach, for servers that cannot
   hold a mark (no `/update_weight_version`) or whose mark is ambiguous.
4. `restore()` (called by `Runtime.stop` for servers it attached to by URL) leaves every server as
   it was before any runtime touched it: awake (weights resumed and reloaded from its model path
   under the weight version it reported at attach, KV cache resumed, plain version), so other clients
   (a `/health` monitor, the next run) never meet released memory — unless a runtime had parked it
   (`park()`, `engine.restore_on_stop: false`: asleep on purpose), which stays parked. A server found
   asleep or half-awake without that is the leftover of a runtime that died, and is woken.
5. **One runtime at a time: owner leases.** From `attach()` until it lets the servers go (`restore` /
   `park`, or `close`), every mark this lifecycle writes — awake or asleep — carries its `Lease`
   (`agentloop.engine.lease`: owner `HOST:PID:NONCE`, the machine's boot/PID-namespace id, the
   owner process's start time, an expiry `lease_timeout` ahead, renewed at every wake-up and sleep
   and, during a rollout, by `keep_lease`; not between steps, the trainer's time). A runtime
   attaching to a server whose lease another *live* owner holds is refused with a
   `LifecycleError` naming the owner and `engine.takeover` (mid-step, its start-up sleep would abort
   the owner's requests and release memory under it, and the owner's next release would crash
   SGLang). Live means: on the same machine, the owner's process exists with the recorded start
   time (and, in this very process, its `Lifecycle` is not closed) — so a SIGKILLed owner is taken
   over at once; on another machine, the lease has not expired. `engine.takeover` (`takeover=True`)
   takes the server anyway. Two runtimes attaching at the same moment cannot both win: each writes
   its lease, waits `acquire_settle`, and reads it back (Fischer's mutual exclusion; SGLang has no
   compare-and-set). The owner checks its lease in every liveness probe: a server whose mark names
   someone else is taken out of its rotation at once, before any memory call, and never touched
   again while that owner lives (so a takeover never causes a double release); a server whose mark
   lost every lease (restarted, or let go) is re-admitted at the next wake-up in its real state.
   Generate responses carry the server's whole weight version, so the gate strips the mark
   (`served_version`): trajectories record the plain version. Servers that keep no mark (no
   `/update_weight_version`) get no lease, and are not protected.
So any number of runtimes in sequence can attach to one server, a runtime SIGKILLed at any stage
leaves a mark from which the next run either recovers (every stage boundary) or refuses with the
exact remedy (killed during the one memory call in flight), and a runtime attaching while another
drives the server is refused instead of breaking it.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Literal, Mapping, Sequence, Union

import anyio

from .base import MEMORY_TAGS, EngineClient, EngineError, GenerateOutput, SamplingParams
from .gate import Gate, GateControl
from .lease import Lease, new_lease, owner_status, register, unregister
from .lifecycle_types import (
    SLEEP_STAGES,
    EngineState,
    LifecycleError,
    MemoryMark,
    StageRecord,
    Weights,
    same_weights,
)

__all__ = ["SLEEP_STAGES", "AttachState", "EngineState", "Lifecycle", "LifecycleError", "StageRecord", "Weights"]

log = logging.getLogger(__name__)

#: "auto" (read each server's mark), "awake" (nothing released), "asleep" (every tag released), or the
#: exact list of released tags.
AttachState = Union[Literal["auto", "awake", "asleep"], Sequence[str]]
_PROBE_ERRORS = (EngineError, TimeoutError, OSError)
#: Generation is impossible while either of these is released, so nothing can be running to drain.
_GENERATION_TAGS = frozenset({"weights", "kv_cache"})


@dataclass
class _Server:
    client: EngineClient
    released: set[str] = field(default_factory=set)
    model_path: str | None = None
    #: why the server is out of rotation (None: in rotation)
    out: str | None = None
    #: whether the server keeps our `MemoryMark` (False once it refused `/update_weight_version`)
    marks: bool = True
    #: the weight version string the server reports now, as last written or read
    mark: str | None = None
    #: what the first attach found (restored by `restore`)
    found: MemoryMark | None = None
    #: left asleep on purpose (`park`): recorded in its mark when the lifecycle lets it go
    parked: bool = False
    #: the server's mark carries this lifecycle's lease (what the liveness probe checks it still does)
    leased: bool = False

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def may_be_running(self) -> bool:
        return not (self.released & _GENERATION_TAGS)


class Lifecycle:
    """State machine over `clients` that opens and closes the gates it owns (see the module docstring).

    `awake` declares the engines' present state without asking them (`attach()` asks). `staged=False`
    selects one-stage wake-up (for engines without memory tags). `reload_path` is the folder to reload
    when weights were released and no new weights are given (default: each server's
    `model_info()["model_path"]`). `liveness_timeout` bounds the `/model_info` probe before each
    wake-up and sleep. `attach_state` overrides what `attach()` finds ("auto": read each server's
    mark). `on_generate(url, state)` is the local gate's instrumentation hook. `takeover` lets
    `attach()` take servers whose lease a live (or not yet expired) owner holds; `lease_timeout` is
    how long this lifecycle's own lease lasts unless renewed (see the module docstring).
    """

    #: Seconds between writing a new lease and reading it back (mutual exclusion of two runtimes
    #: attaching at the same moment: whoever wrote last holds the server, the other is refused).
    acquire_settle: float = 0.5

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
        liveness_timeout: float = 5.0,
        attach_state: AttachState = "auto",
        on_generate: Callable[[str, EngineState], None] | None = None,
        takeover: bool = False,
        lease_timeout: float = 600.0,
    ) -> None:
        if not clients:
            raise ValueError("Lifecycle needs at least one engine client")
        if isinstance(attach_state, str):
            if attach_state not in ("auto", "awake", "asleep"):
                raise ValueError(f"attach_state must be auto|awake|asleep or a list of released tags, not {attach_state!r}")
        elif set(attach_state) - set(MEMORY_TAGS):
            raise ValueError(f"attach_state: unknown memory tags {sorted(set(attach_state) - set(MEMORY_TAGS))}")
        self._servers: dict[str, _Server] = {c.url: _Server(c) for c in clients}
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
        self.liveness_timeout = liveness_timeout
        self.attach_state: AttachState = attach_state if isinstance(attach_state, str) else list(attach_state)
        self.takeover = takeover
        self.lease_timeout = lease_timeout
        #: this lifecycle's claim on its servers, written into their marks until it lets them go
        self.lease: Lease = new_lease(lease_timeout)
        self._holding = True
        register(self.lease, self)
        self._state = EngineState.AWAKE if awake else EngineState.SLEEPING
        if not awake:
            for s in self._servers.values():
                s.released = set(self.release_tags)
        #: The gate of this process: the one road to generate and /health (its router's).
        self.gate = Gate(clients, awake=awake, on_generate=on_generate, on_take_out=self.take_out)
        self._gates: list[GateControl] = [self.gate]
        self._transition_lock = anyio.Lock()
        self._last_weights: Weights | None = None
        self._waking: tuple[Weights | None, anyio.Event, list[BaseException]] | None = None
        self._sleep_resume_at: str | None = None
        self._version_counter = itertools.count(1)
        self.weight_version: str | None = None
        self.records: list[StageRecord] = []
        #: Servers leaving and re-entering rotation: {"time", "url", "event": "out" | "in", "reason"}.
        self.server_events: list[dict[str, Any]] = []
        #: Wall-clock spans during which the gates were open: [opened, closing). Each starts after
        #: AWAKE was reached and ends before AWAKE is left (checked against dispatch times by tests).
        self.gate_windows: list[list[float]] = []

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def on_generate(self) -> Callable[[str, EngineState], None] | None:
        """The local gate's dispatch hook (`on_generate(url, state)`), settable here as before the
        gate/lifecycle split so instrumentation written against the lifecycle keeps recording."""
        return self.gate.on_generate

    @on_generate.setter
    def on_generate(self, hook: Callable[[str, EngineState], None] | None) -> None:
        self.gate.on_generate = hook

    @property
    def urls(self) -> list[str]:
        """Servers in rotation."""
        return [u for u, s in self._servers.items() if s.out is None]

    @property
    def clients(self) -> list[EngineClient]:
        return [s.client for s in self._servers.values() if s.out is None]

    @property
    def out_of_rotation(self) -> dict[str, str]:
        """Servers out of rotation now, with why."""
        return {u: s.out for u, s in self._servers.items() if s.out is not None}

    @property
    def generations_outside_awake(self) -> int:
        return self.gate.generations_outside_awake

    @property
    def sleep_resume_at(self) -> str | None:
        """The sleep stage a retried `sleep()` starts at (None unless a sleep failed part-way)."""
        return self._sleep_resume_at

    def add_gates(self, gates: GateControl) -> None:
        """Own more gates (Ray: every worker's, through the pool); they follow every later transition."""
        self._gates.append(gates)

    def _set_state(self, state: EngineState) -> None:
        log.debug("lifecycle %s -> %s", self._state.value, state.value)
        self._state = state

    def _in_rotation(self) -> list[_Server]:
        return [s for s in self._servers.values() if s.out is None]

    # The gate's road, for callers holding the lifecycle (the gate does the work).
    def in_flight(self, url: str | None = None) -> int:
        return self.gate.in_flight(url)

    async def wait_awake(self, timeout: float | None = None) -> None:
        await self.gate.wait_awake(timeout)

    async def generate(self, url: str, input_ids: Sequence[int], sampling_params: SamplingParams, **kw: Any) -> GenerateOutput:
        return await self.gate.generate(url, input_ids, sampling_params, **kw)

    async def health(self, url: str) -> bool:
        return await self.gate.health(url)

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort on every server in rotation; raises naming a server that could not be told."""
        failed = await self.gate.abort(rid, abort_all=abort_all)
        if failed:
            url, e = failed[0]
            raise LifecycleError("abort", str(e), url=url, cause=e)

    # ------------------------------------------------------------------ rotation
    async def take_out(self, url: str, reason: str) -> None:
        """Take `url` out of rotation: out of every stage and every gate, until re-admitted."""
        s = self._servers.get(url)
        if s is None or s.out is not None:
            return
        s.out = reason
        self.server_events.append({"time": time.time(), "url": url, "event": "out", "reason": reason})
        log.warning("engine server %s out of rotation: %s", url, reason)
        for g in self._gates:
            await g.take_out(url, reason)

    async def _admit(self, s: _Server) -> None:
        reason, s.out = s.out, None
        self.server_events.append({"time": time.time(), "url": s.url, "event": "in", "reason": f"re-admitted (was: {reason})"})
        log.warning("engine server %s back in rotation (was out: %s)", s.url, reason)
        for g in self._gates:
            await g.admit(s.url)

    def _no_server_left(self, stage: str) -> LifecycleError:
        why = "; ".join(f"{u}: {r}" for u, r in self.out_of_rotation.items())
        return LifecycleError(stage, f"no engine server left ({why})")

    async def _probe(self, *, readmit: bool) -> None:
        """Liveness of every server in rotation (and, with `readmit`, re-admission of those out)."""
        targets = [s for s in self._servers.values() if s.out is None or readmit]
        answers: dict[str, Any] = {}

        async def one(s: _Server) -> None:
            try:
                with anyio.fail_after(self.liveness_timeout):
                    answers[s.url] = await s.client.model_info()
            except _PROBE_ERRORS as e:
                answers[s.url] = e

        async with anyio.create_task_group() as tg:
            for s in targets:
                tg.start_soon(one, s)
        for s in targets:
            a = answers[s.url]
            if s.out is None and isinstance(a, BaseException):
                await self.take_out(s.url, f"failed the liveness probe ({_short(a)})")
            elif s.out is None:
                lost = self._lost(s, a)
                if lost is None:
                    try:
                        await self._mark(s)  # renews the lease when it is half gone
                        continue
                    except _PROBE_ERRORS as e:
                        lost = f"cannot renew this runtime's lease in its mark ({_short(e)})"
                await self.take_out(s.url, lost)
                if readmit:  # held by nobody now (restarted, or let go): ours again, in its real state
                    await self._readmit(s, a)
            elif not isinstance(a, BaseException):
                await self._readmit(s, a)
        if not self._in_rotation():
            raise self._no_server_left("liveness")

    def _lost(self, s: _Server, info: Mapping[str, Any]) -> str | None:
        """Why `s` is no longer held by this lifecycle (its mark lost our lease), or None if it is."""
        if not s.leased or "weight_version" not in info:  # (a server that reports none cannot be read back)
            return None
        reported = str(info["weight_version"])
        lease = MemoryMark.decode(reported).lease
        if lease is not None and lease.owner == self.lease.owner:
            return None
        s.leased = False
        s.mark = reported
        if lease is not None:
            return f"taken over by {lease.describe()}"
        return (f"no longer held by this runtime: its weight version was set to {reported!r} by someone else "
                "(the server restarted, or another client wrote it)")

    async def _readmit(self, s: _Server, info: Mapping[str, Any]) -> None:
        """A server out of rotation answers again: learn its real state, put it to sleep, admit it."""
        try:
            await self._acquire(s, info, initial=False)
            await self._sleep_one(s)
        except (LifecycleError, *_PROBE_ERRORS) as e:
            reason = f"answers again but cannot be re-admitted: {e}"
            if s.out != reason:
                s.out = reason
                log.warning("engine server %s stays out of rotation: %s", s.url, reason)
            return
        await self._admit(s)

    # ------------------------------------------------------------------ attach
    async def attach(self) -> None:
        """Learn each server's real memory state (see the module docstring) before the first call."""
        errors: dict[str, BaseException] = {}

        async def one(s: _Server) -> None:
            try:
                with anyio.fail_after(self.liveness_timeout):
                    info = await s.client.model_info()
                await self._acquire(s, info, initial=True)
            except (LifecycleError, *_PROBE_ERRORS) as e:
                errors[s.url] = e

        async with anyio.create_task_group() as tg:
            for s in self._servers.values():
                tg.start_soon(one, s)
        if errors and len(errors) == len(self._servers):
            if len(errors) == 1:
                e = next(iter(errors.values()))
                raise e if isinstance(e, LifecycleError) else LifecycleError("attach", _short(e), url=next(iter(errors)), cause=e)
            raise LifecycleError("attach", "no engine server can be attached (" + "; ".join(
                f"{u}: {e}" for u, e in errors.items()) + ")")
        for url, e in errors.items():
            await self.take_out(url, f"cannot be attached: {e}")
        # servers holding memory are drained and released by the next sleep (each server's own tags)
        self._state = EngineState.DRAINING if any(not set(self.release_tags) <= s.released for s in self._in_rotation()) \
            else EngineState.SLEEPING
        self._sleep_resume_at = None
        await self.gate.close()

    async def _acquire(self, s: _Server, info: Mapping[str, Any], *, initial: bool) -> None:
        """Take `s` (its state from `info`, a `/model_info` read just now) under this lifecycle's lease.

        Refused while another live owner holds it (`_check_lease`). Two runtimes attaching at the
        same moment cannot both pass (SGLang has no compare-and-set; this is Fischer's mutual
        exclusion): each writes its lease right after reading the server free, waits
        `acquire_settle` (longer than any read-then-write may take: a slower one reads again), and
        reads the mark back; only the last writer finds its own lease there."""
        t0 = time.monotonic()
        await self._resolve(s, info, initial=initial)
        for attempt in range(3):
            s.mark = None  # (re)write the mark: our lease
            await self._mark(s)
            took = time.monotonic() - t0
            if not s.marks or took <= self.acquire_settle / 2:
                break
            if attempt == 2:
                log.warning("engine server %s: reading and marking it took %.2fs (> engine lease settle %.2fs / 2): "
                            "another runtime attaching at this very moment may not be excluded", s.url, took,
                            self.acquire_settle)
                break
            t0 = time.monotonic()  # too slow to exclude anyone: read again before writing again
            with anyio.fail_after(self.liveness_timeout):
                self._check_lease(s, MemoryMark.decode(str((await s.client.model_info()).get("weight_version", ""))))
        if not s.marks or self.acquire_settle <= 0:
            return
        await anyio.sleep(max(self.acquire_settle, 2 * took))
        with anyio.fail_after(self.liveness_timeout):
            info = await s.client.model_info()
        if "weight_version" not in info:
            return
        reported = str(info["weight_version"])
        held = MemoryMark.decode(reported).lease
        if held is None or held.owner != self.lease.owner:
            s.leased = False
            raise LifecycleError(
                "attach", "another runtime attached to this server at the same moment and holds it now ("
                + (held.describe() if held else f"its weight version was set to {reported!r}") + "); run one at a time",
                url=s.url)

    def _check_lease(self, s: _Server, mark: MemoryMark) -> None:
        """Refuse a server another runtime drives now; say so when a dead or expired one is taken over."""
        lease = mark.lease
        if lease is None:
            return
        status = owner_status(lease, self.lease)
        if status == "ours":
            return
        if status in ("alive", "unknown") and not self.takeover:
            where = "a live process on this machine" if status == "alive" else "on another machine; its lease has not expired"
            raise LifecycleError(
                "attach", f"another runtime drives this server now: {lease.describe()}, {where}. Attaching would put "
                "the server to sleep under it and release memory it is using (SGLang crashes when that runtime then "
                "releases it again). Wait for that run to end (it lets the server go when it stops), or stop it; only "
                "if it is dead (its machine is gone) set engine.takeover: true (agentloop rollout: --set "
                "runtime.engine.takeover=true). A lease nobody renews lapses after its owner's engine.lease_timeout",
                url=s.url)
        why = {"dead": "its process is gone", "expired": "its lease expired"}.get(status, "engine.takeover is set")
        log.warning("engine server %s: taking it over from %s: %s", s.url, lease.describe(), why)

    async def _resolve(self, s: _Server, info: Mapping[str, Any], *, initial: bool) -> None:
        """Set `s.released` to what the server really holds, from its mark (or the configured state)."""
        reported = str(info.get("weight_version", "default"))
        mark = MemoryMark.decode(reported)
        self._check_lease(s, mark)
        s.mark = reported
        if s.model_path is None and info.get("model_path"):
            s.model_path = str(info["model_path"])
        if initial and self.attach_state != "auto":
            if isinstance(self.attach_state, list):
                released = set(self.attach_state)
            else:
                released = set(self.release_tags) | set(mark.released) if self.attach_state == "asleep" else set()
        elif not s.marks:  # a server that keeps no mark and comes back: restarted (awake) or not (as left)?
            truth = await _reported_released(s.client)
            if truth is None:
                raise LifecycleError(
                    "attach", "the server keeps no memory mark (it refused /update_weight_version), so whether it "
                    "was restarted (awake) or kept its released memory cannot be known; restart the runtime with "
                    "engine.attach_state set", url=s.url)
            released = truth
        elif mark.pending is not None:
            truth = await _reported_released(s.client)
            if truth is None:
                op, _, text = mark.pending.partition(":")
                tags = set(text.split(","))
                done = mark.released | tags if op == "release" else mark.released - tags
                raise LifecycleError(
                    "attach", f"a runtime stopped while its /{op}_memory_occupation({sorted(tags)}) call was on the wire "
                    "(the server's weight version says so), and SGLang cannot be asked whether that call took effect: "
                    "a wrong guess crashes it. Restart the server (a fresh one is awake), or, if you know, set "
                    f"engine.attach_state: {self._as_setting(done)} if the call took effect, "
                    f"{self._as_setting(mark.released)} if it did not", url=s.url)
            released = truth
        else:
            released = set(mark.released)
        s.released = released
        if initial or s.found is None:
            s.found = MemoryMark(mark.version, frozenset(released), parked=mark.parked)
        log.info("engine server %s attached: %s", s.url,
                 f"released {sorted(released)}" if released else "awake (nothing released)")

    def _as_setting(self, released: set[str] | frozenset[str]) -> str:
        """The `engine.attach_state` value that says `released`."""
        if not released:
            return "awake"
        if set(released) == set(self.release_tags):
            return "asleep"
        return "[" + ", ".join(sorted(released)) + "]"

    # ------------------------------------------------------------------ gates
    async def _open_gates(self) -> None:
        if not self.gate_windows or len(self.gate_windows[-1]) == 2:
            self.gate_windows.append([time.time()])
        for g in self._gates:
            await g.open(self.weight_version)

    async def _close_gates(self) -> None:
        for g in self._gates:
            await g.close()
        if self.gate_windows and len(self.gate_windows[-1]) == 1:
            self.gate_windows[-1].append(time.time())

    # ------------------------------------------------------------------ transitions
    async def wake_up(self, weights: "Weights | Mapping[str, Any] | str | Path | None" = None) -> str | None:
        """Staged wake-up; returns the weight version now served.

        "The same weights" means the same state dict object or the same path (see `same_weights`),
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
                await self._open_gates()
                return self.weight_version
            if self._state is EngineState.DRAINING:
                # the lock is free, so no sleep is running: the last one failed part-way
                raise LifecycleError(
                    "wake_up", f"the last sleep failed at stage '{self._sleep_resume_at}' and the "
                    "engines are DRAINING; call sleep() to finish it, then wake_up")
            self._waking = (w, anyio.Event(), [])
            try:
                if self._state is EngineState.SLEEPING:
                    await self._probe(readmit=True)
                await self._wake_stages(w)
                self._last_weights = w
                await self._open_gates()
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
        """Close every gate, abort and settle in-flight requests, flush, release every tag.

        From AWAKE every stage runs. After a failed sleep (state DRAINING) a retry resumes at the
        stage that failed, like a retried wake-up: a failed flush_cache is flushed again before the
        release, a failed release is only released again (each server's released tags are tracked,
        so nothing is released twice). From a wake-up that stopped part-way nothing was generated,
        so only the release runs. Servers with nothing that can run skip the draining stages.
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
            self._sleep_resume_at = first
            await self._close_gates()  # before any engine is paused: no gate dispatches from here on
            # (re-admission only when nothing is left in rotation: the next wake-up probes the rest)
            await self._probe(readmit=not self._in_rotation())
            for stage in SLEEP_STAGES[SLEEP_STAGES.index(first):]:
                # set before the stage runs, so an error or a cancellation leaves it pointing here
                self._sleep_resume_at = stage
                await self._stage("sleep", stage, self._sleep_stage(stage))
            self._sleep_resume_at = None
            self._set_state(EngineState.SLEEPING)
            for g in self._gates:
                await g.mark_sleeping()

    def _sleep_stage(self, stage: str) -> Callable[[_Server], Awaitable[Any]]:
        run: dict[str, Callable[[_Server], Awaitable[Any]]] = {
            "pause": lambda s: s.client.pause_generation("abort"),
            "settle": self._settle,
            # the engine is not left paused while asleep, so a wake-up needs no continue
            "continue": lambda s: s.client.continue_generation(),
            "flush_cache": self._flush,
            "release": self._release,
        }
        fn = run[stage]
        if stage == "release":
            return fn

        async def draining(s: _Server) -> Any:
            if s.may_be_running:  # a server holding no weights or KV cache has nothing to drain
                return await fn(s)

        return draining

    async def _sleep_one(self, s: _Server) -> None:
        """Put one (re-admitted) server to sleep on its own: every sleep stage, in order."""
        for stage in SLEEP_STAGES:
            with anyio.fail_after(self.stage_timeout):
                await self._sleep_stage(stage)(s)

    async def park(self) -> None:
        """Mark every sleeping server in rotation as left asleep on purpose (see `MemoryMark.parked`),
        and let them go (`close`)."""
        async with self._transition_lock:
            self._park(self._in_rotation())
            await self._let_go()

    def _park(self, servers: Sequence[_Server]) -> None:
        if self._state is EngineState.SLEEPING:
            for s in servers:
                s.parked = True

    async def _let_go(self) -> None:
        """Stop holding the servers: their marks lose this lifecycle's lease (a server woken
        completely reports its plain weight version again), then `close`."""
        self._holding = False
        for s in self._in_rotation():
            if s.leased or s.parked:
                try:
                    await self._mark(s)
                except _PROBE_ERRORS as e:  # unreachable: its lease lapses when this process ends
                    log.warning("engine server %s: could not clear this runtime's lease (%s)", s.url, _short(e))
        self.close()

    async def keep_lease(self) -> None:
        """Renew this lifecycle's lease in its servers' marks until cancelled (run it beside a step's
        rollout: the wake-up and the sleep renew it, this covers a rollout longer than half of
        `lease_timeout`). A failed write is only logged: the step's own stages say what is wrong."""
        while self._holding:
            await anyio.sleep(self.lease_timeout / 4)
            async with self._transition_lock:
                for s in self._in_rotation():
                    try:
                        with anyio.fail_after(self.liveness_timeout):
                            await self._mark(s)
                    except (*_PROBE_ERRORS, LifecycleError) as e:
                        log.warning("engine server %s: could not renew this runtime's lease (%s)", s.url, _short(e))

    def close(self) -> None:
        """This lifecycle drives nothing from now on: its lease, wherever a server still carries it,
        belongs to a dead owner (another runtime takes the server over at once). `restore` and
        `park` call it; call it yourself for a lifecycle abandoned without either."""
        self._holding = False
        unregister(self.lease)

    async def restore(self) -> None:
        """Leave every server in rotation as it was found (see the module docstring): a parked one
        parked; any other awake (resume its weights, reload them from its model path under the version
        it had, resume the rest). Called when a runtime that attached to running servers stops."""
        async with self._transition_lock:
            self._park([s for s in self._in_rotation() if s.found is not None and s.found.parked])
            todo = [s for s in self._in_rotation() if s.found is not None and not s.found.parked and s.released]
            if todo and self._state is not EngineState.AWAKE:
                await self._restore(todo)
            await self._let_go()

    async def _restore(self, todo: Sequence[_Server]) -> None:
        if self._state is not EngineState.SLEEPING:
            log.warning("restoring engine servers from %s (the last sleep failed at %r)",
                        self._state.value, self._sleep_resume_at)

        async def one(s: _Server) -> None:
            reload = "weights" in s.released
            await self._resume(s, ["weights"])
            assert s.found is not None
            if reload:
                await self._reload(s, s.found.version)
            await self._resume(s, sorted(s.released))
            await self._mark(s)

        await self._stage("restore", "restore", one, servers=todo)
        log.info("engine servers %s left awake, as found", [s.url for s in todo])

    # ------------------------------------------------------------------ stages
    def _next_version(self, w: Weights) -> str:
        return w.version or f"v{next(self._version_counter)}"

    async def _load_weights(self, w: Weights | None) -> None:
        if w is None:
            # Released weights have lost their values (SGLang zeroes them): reload from disk.
            if "weights" in self.release_tags:
                version = self.weight_version or "default"
                await self._stage("wake_up", "update_weights", lambda s: self._reload(s, version))
            return
        version = self._next_version(w)
        await self._stage("wake_up", "update_weights", lambda s: self._load(s, w, version))

    def _load_version(self, s: _Server, version: str) -> str:
        """The `weight_version` a load sends: the version, marked with what is still released (and the lease)."""
        return MemoryMark(version, frozenset(s.released), lease=self._held_lease()).encode() if s.marks else version

    def _held_lease(self) -> Lease | None:
        """The lease to write now (renewed when half gone), or None once this lifecycle let go."""
        if not self._holding:
            return None
        if self.lease.due(self.lease_timeout):
            self.lease = self.lease.renewed(self.lease_timeout)
        return self.lease

    async def _reload(self, s: _Server, version: str) -> None:
        path = self.reload_path or s.model_path
        if path is None:
            info = await s.client.model_info()
            path = s.model_path = info.get("model_path")
        if not path:
            raise LifecycleError(
                "update_weights", "weights were released and no new weights were given, and the server "
                "reports no model_path to reload from; pass weights= to wake_up", url=s.url)
        sent = self._load_version(s, version)
        await s.client.update_weights_from_disk(path, weight_version=sent, flush_cache=True)
        s.mark, s.leased = sent, MemoryMark.decode(sent).lease is not None
        self.weight_version = version

    async def _load(self, s: _Server, w: Weights, version: str) -> None:
        sent = self._load_version(s, version)
        if w.state_dict is not None:
            await s.client.update_weights_from_tensor(
                list(w.state_dict.items()), load_format=w.load_format, weight_version=sent, flush_cache=True)
        elif w.path is not None:
            await s.client.update_weights_from_disk(w.path, load_format=w.load_format, weight_version=sent, flush_cache=True)
        else:
            raise LifecycleError("update_weights", "Weights has neither a state_dict nor a path", url=s.url)
        s.mark, s.leased = sent, MemoryMark.decode(sent).lease is not None
        self.weight_version = version

    async def _memory_call(self, s: _Server, op: Literal["release", "resume"], tags: list[str]) -> None:
        """One release/resume, with the server's mark saying it is pending until it is answered."""
        await self._mark(s, pending=f"{op}:{','.join(tags)}")
        call = s.client.release_memory_occupation if op == "release" else s.client.resume_memory_occupation
        try:
            await call(tags)
        except EngineError as e:
            if e.status is not None:  # the server answered and refused: nothing changed
                await self._mark(s)
            raise
        if op == "release":
            s.released.update(tags)
        else:
            s.released.difference_update(tags)
            s.parked = False
        await self._mark(s)

    async def _mark(self, s: _Server, *, pending: str | None = None) -> None:
        """Record `s`'s memory state (and, while this lifecycle holds it, its lease, renewed when half
        gone) in its weight version (see `MemoryMark`), if it changed."""
        if not s.marks:
            return
        version = self.weight_version or (s.found.version if s.found is not None else "default")
        lease = self._held_lease()
        text = MemoryMark(version, frozenset(s.released), pending, s.parked and bool(s.released), lease).encode()
        if text == s.mark:
            return
        update = getattr(s.client, "update_weight_version", None)
        try:
            if update is None:
                raise EngineError("/update_weight_version", None, "this client cannot set a weight version", url=s.url)
            await update(text, abort_all_requests=False)
        except EngineError as e:
            if e.status is None and update is not None:
                raise  # unreachable: the stage fails for this server
            s.marks = False
            log.warning("engine server %s cannot record its memory state in its weight version (%s): a runtime "
                        "killed while it sleeps leaves a state the next run must be told with engine.attach_state",
                        s.url, e)
            return
        s.mark = text
        s.leased = lease is not None

    async def _resume(self, s: _Server, tags: Sequence[str]) -> None:
        todo = [t for t in tags if t in s.released]
        if todo:
            await self._memory_call(s, "resume", todo)
        elif not s.released:
            await self._mark(s)  # fully resident: the plain version

    async def _release(self, s: _Server) -> None:
        todo = [t for t in self.release_tags if t not in s.released]
        if todo:
            await self._memory_call(s, "release", todo)

    async def _settle(self, s: _Server) -> None:
        left = 0
        for g in self._gates:
            left += await g.wait_settled(s.url, self.settle_timeout)
        if left:
            raise LifecycleError("settle", f"{left} requests still in flight after {self.settle_timeout:.0f}s", url=s.url)

    async def _flush(self, s: _Server) -> None:
        for _ in range(self.flush_retries):
            if await s.client.flush_cache():
                return
            await anyio.sleep(self.flush_retry_delay)
        raise LifecycleError("flush_cache", f"engine still busy after {self.flush_retries} tries", url=s.url)

    async def _stage(self, phase: str, stage: str, fn: Callable[[_Server], Awaitable[Any]],
                     servers: Sequence[_Server] | None = None) -> None:
        start = time.monotonic()
        targets = list(servers) if servers is not None else self._in_rotation()
        await self._fan_out(stage, fn, targets)
        self.records.append(StageRecord(phase, stage, start, time.monotonic(), {"servers": len(targets)}))

    async def _fan_out(self, stage: str, fn: Callable[[_Server], Awaitable[Any]], targets: Sequence[_Server]) -> None:
        """Run `fn` on every target; servers that fail are taken out while others succeed. If every
        target fails, nothing is taken out and the error (naming each server) is raised."""
        if not targets:
            raise self._no_server_left(stage)
        errors: dict[str, LifecycleError] = {}

        async def one(s: _Server) -> None:
            try:
                with anyio.fail_after(self.stage_timeout):
                    await fn(s)
            except LifecycleError as e:
                errors[s.url] = e
            except _PROBE_ERRORS as e:
                errors[s.url] = LifecycleError(stage, str(e), url=s.url, cause=e)

        async with anyio.create_task_group() as tg:
            for s in targets:
                tg.start_soon(one, s)
        if not errors:
            return
        if len(errors) == len(targets):
            if len(errors) == 1:
                raise next(iter(errors.values()))
            raise LifecycleError(stage, "failed on every engine server (" + "; ".join(
                f"{u}: {e}" for u, e in errors.items()) + ")")
        for url, e in errors.items():
            await self.take_out(url, str(e))


async def _reported_released(client: EngineClient) -> set[str] | None:
    """The released tags a server reports itself (the CPU engine does; SGLang 0.5.17 does not)."""
    try:
        info = await client.server_info()
    except EngineError:
        return None
    for part in [info, *(info.get("internal_states") or [])]:
        tags = part.get("released_tags") if isinstance(part, Mapping) else None
        if isinstance(tags, list):
            return {str(t) for t in tags}
    return None


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
