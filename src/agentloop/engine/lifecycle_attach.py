"""Attach state: knowing each server's memory before the first call, and taking it under this
lifecycle's lease.

SGLang 0.5.17 does not report its released memory tags over HTTP, and it crashes on a release of
released memory ("Cannot pause allocation that is not active") and on a resume of resident memory
(KeyError in its scheduler). So:

1. The lifecycle *records* each server's memory state in the server itself (`MemoryMark`, written
   around every release and resume: `lifecycle_marks.py`).
2. `attach()` (called by `Runtime.start`, and for every re-admitted server) reads `/model_info`:
   no mark = nothing released (a fresh server, or one left awake); a mark = exactly its tags. A mark
   with a pending call (a runtime killed while that call was on the wire) is resolved by the server's
   own report if it has one (the CPU engine's `/server_info` lists `released_tags`); otherwise the
   server is refused with a message that says what to do: restart it, or set `engine.attach_state`.
3. `engine.attach_state` (`awake` | `asleep`) overrides the probe at attach, for servers that cannot
   hold a mark (no `/update_weight_version`) or whose mark is ambiguous.
4. `restore()` (`lifecycle.py`, called by `Runtime.stop` for servers it attached to by URL) leaves
   every server as it was before any runtime touched it: awake (weights resumed and reloaded from its
   model path under the weight version it reported at attach, KV cache resumed, plain version), so
   other clients (a `/health` monitor, the next run) never meet released memory — unless a runtime
   had parked it (`park()`, `engine.restore_on_stop: false`: asleep on purpose), which stays parked.
   A server found asleep or half-awake without that is the leftover of a runtime that died, and is
   woken.
5. One runtime at a time: attaching takes the server under this lifecycle's lease, refused while
   another live owner holds it (`lifecycle_owner.py`).

So any number of runtimes in sequence can attach to one server, a runtime SIGKILLed at any stage
leaves a mark from which the next run either recovers (every stage boundary) or refuses with the
exact remedy (killed during the one memory call in flight), and a runtime attaching while another
drives the server is refused instead of breaking it.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Mapping, Sequence, Union

import anyio

from .lifecycle_drain import DrainMixin
from .lifecycle_server import PROBE_ERRORS, TrackedServer, log, reported_released, short_error
from .lifecycle_types import EngineState, LifecycleError, MemoryMark

__all__ = ["AttachMixin", "AttachState"]

#: "auto" (read each server's mark), "awake" (nothing released), "asleep" (every tag released), or the
#: exact list of released tags.
AttachState = Union[Literal["auto", "awake", "asleep"], Sequence[str]]


class AttachMixin(DrainMixin):
    """`attach()`, and learning one server's real memory state under this lifecycle's lease."""

    #: Seconds between writing a new lease and reading it back (mutual exclusion of two runtimes
    #: attaching at the same moment: whoever wrote last holds the server, the other is refused).
    acquire_settle: float = 0.5

    attach_state: AttachState
    _state: EngineState
    _sleep_resume_at: str | None

    async def attach(self) -> None:
        """Learn each server's real memory state (see the module docstring) before the first call."""
        errors: dict[str, BaseException] = {}

        async def one(s: TrackedServer) -> None:
            try:
                with anyio.fail_after(self.liveness_timeout):
                    info = await s.client.model_info()
                await self._acquire(s, info, initial=True)
            except (LifecycleError, *PROBE_ERRORS) as e:
                errors[s.url] = e

        async with anyio.create_task_group() as tg:
            for s in self._servers.values():
                tg.start_soon(one, s)
        if errors and len(errors) == len(self._servers):
            if len(errors) == 1:
                e = next(iter(errors.values()))
                raise e if isinstance(e, LifecycleError) else LifecycleError("attach", short_error(e), url=next(iter(errors)), cause=e)
            raise LifecycleError("attach", "no engine server can be attached (" + "; ".join(
                f"{u}: {e}" for u, e in errors.items()) + ")")
        for url, e in errors.items():
            await self.take_out(url, f"cannot be attached: {e}")
        # servers holding memory are drained and released by the next sleep (each server's own tags)
        self._state = EngineState.DRAINING if any(not set(self.release_tags) <= s.released for s in self._in_rotation()) \
            else EngineState.SLEEPING
        self._sleep_resume_at = None
        await self.gate.close()

    async def _acquire(self, s: TrackedServer, info: Mapping[str, Any], *, initial: bool) -> None:
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

    async def _resolve(self, s: TrackedServer, info: Mapping[str, Any], *, initial: bool) -> None:
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
            truth = await reported_released(s.client)
            if truth is None:
                raise LifecycleError(
                    "attach", "the server keeps no memory mark (it refused /update_weight_version), so whether it "
                    "was restarted (awake) or kept its released memory cannot be known; restart the runtime with "
                    "engine.attach_state set", url=s.url)
            released = truth
        elif mark.pending is not None:
            truth = await reported_released(s.client)
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
