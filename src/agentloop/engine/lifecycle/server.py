"""One engine server as a lifecycle drives it (`ServerDriver`): what it knows of the server's memory,
the memory calls that change it (release, resume, weight loads), the `MemoryMark` written around each
one, the owner-lease checks, the liveness probe and the sleep work that runs on this server alone.

SGLang 0.5.17 does not report its released memory tags over HTTP, and it crashes on a release of
released memory ("Cannot pause allocation that is not active") and on a resume of resident memory
(KeyError in its scheduler). So:

1. The driver *records* the server's memory state in the server itself (`MemoryMark`, written around
   every release and resume; "pending" names a memory call sent and not yet answered).
2. `acquire` (at attach, and for every re-admitted server) reads `/model_info`: no mark = nothing
   released (a fresh server, or one left awake); a mark = exactly its tags. A mark with a pending call
   (a runtime killed while that call was on the wire) is resolved by the server's own report if it
   has one (the CPU engine's `/server_info` lists `released_tags`); otherwise the server is refused
   with a message that says what to do: restart it, or set `engine.attach_state`.
3. `engine.attach_state` (`awake` | `asleep`) overrides the probe at attach, for servers that cannot
   hold a mark (no `/update_weight_version`) or whose mark is ambiguous.
4. One runtime at a time: acquiring takes the server under this lifecycle's lease (`owner.py`).

So any number of runtimes in sequence can attach to one server, a runtime SIGKILLed at any stage
leaves a mark from which the next run either recovers (every stage boundary) or refuses with the
exact remedy (killed during the one memory call in flight).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Literal, Mapping, Sequence

import anyio

from ..base import EngineClient, EngineError, PauseMode
from ..memory_mark import MarkFormatError, MemoryMark, foreign_mark
from .log import GENERATION_TAGS, log
from .owner import Owner
from .types import LifecycleError, LifecycleSettings, Weights

__all__ = ["ServerDriver", "reported_released"]


async def reported_released(client: EngineClient) -> set[str] | None:
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


class ServerDriver:
    """One server: its client and what the lifecycle knows of its memory, mark, lease and rotation.

    `served()` is the weight version the lifecycle serves now (written into marks until this server
    was loaded by this lifecycle, after which `version` says what it serves).
    """

    def __init__(self, client: EngineClient, *, owner: Owner, settings: LifecycleSettings,
                 served: Callable[[], str | None]) -> None:
        self.client = client
        self.owner = owner
        self.settings = settings
        self.served = served
        #: memory tags released now
        self.released: set[str] = set()
        self.model_path: str | None = None
        #: why the server is out of rotation (None: in rotation)
        self.out: str | None = None
        #: whether the server keeps our `MemoryMark` (False once it refused `/update_weight_version`)
        self.marks = True
        #: the weight version string the server reports now, as last written or read
        self.mark_text: str | None = None
        #: The mark the server reported before the last load (`Fleet.answer_lost`).
        self.mark_before_load: str | None = None
        #: what the first attach found (restored by `restore`)
        self.found: MemoryMark | None = None
        #: left asleep on purpose (`park`): recorded in its mark when the lifecycle lets it go
        self.parked = False
        #: the server's mark carries this lifecycle's lease (what the liveness probe checks it still does)
        self.leased = False
        #: the weight version this lifecycle last loaded into this server (None: never loaded here)
        self.version: str | None = None

    def __repr__(self) -> str:
        return f"ServerDriver({self.url!r}, released={sorted(self.released)}, out={self.out!r})"

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def may_be_running(self) -> bool:
        """Whether requests can be running (nothing generation needs is released)."""
        return not (self.released & GENERATION_TAGS)

    def read_mark(self, weight_version: str, stage: str = "attach") -> MemoryMark:
        try:
            return MemoryMark.decode(weight_version)
        except MarkFormatError as e:
            raise LifecycleError(stage, str(e), url=self.url) from None

    # ------------------------------------------------------------------ marks
    async def mark(self, *, pending: str | None = None) -> None:
        """Record the server's memory state (and, while this lifecycle holds it, its lease, renewed
        when half gone) in its weight version (see `MemoryMark`), if it changed."""
        if not self.marks:
            return
        version = self.version or self.served() or (self.found.version if self.found is not None else "default")
        lease = self.owner.held_lease()
        text = MemoryMark(version, frozenset(self.released), pending, self.parked and bool(self.released), lease).encode()
        if text == self.mark_text:
            return
        update = getattr(self.client, "update_weight_version", None)
        try:
            if update is None:
                raise EngineError("/update_weight_version", None, "this client cannot set a weight version", url=self.url)
            await update(text, abort_all_requests=False)
        except EngineError as e:
            if e.status is None and update is not None:
                raise  # unreachable: the stage fails for this server
            self.marks = False
            log.warning("engine server %s cannot record its memory state in its weight version (%s): a runtime "
                        "killed while it sleeps leaves a state the next run must be told with engine.attach_state",
                        self.url, e)
            return
        self.mark_text = text
        self.leased = lease is not None

    def load_version(self, version: str) -> str:
        """The `weight_version` a load sends: the version, marked with what is still released (and the lease)."""
        if not self.marks:
            return version
        return MemoryMark(version, frozenset(self.released), lease=self.owner.held_lease()).encode()

    # ------------------------------------------------------------------ memory calls
    async def load(self, w: Weights, version: str, *, flush_cache: bool = True, abort_all: bool = False) -> None:
        """Load `w` as `version` (`flush_cache=False` while requests are paused in the engine: SGLang
        asserts its flush succeeds after an update, and a flush fails while any request is queued;
        `abort_all`: the server aborts every request first and loads once they ended)."""
        sent = self.load_version(version)
        if w.state_dict is not None:
            await self.client.update_weights_from_tensor(
                list(w.state_dict.items()), load_format=w.load_format, weight_version=sent, flush_cache=flush_cache,
                abort_all_requests=abort_all)
        elif w.path is not None:
            await self.client.update_weights_from_disk(w.path, load_format=w.load_format, weight_version=sent,
                                                       flush_cache=flush_cache, abort_all_requests=abort_all)
        else:
            raise LifecycleError("update_weights", "Weights has neither a state_dict nor a path", url=self.url)
        self._loaded(sent, version)

    async def reload(self, version: str) -> None:
        """Reload the weights from disk (released weights lost their values) as `version`."""
        path = self.settings.reload_path or self.model_path
        if path is None:
            info = await self.client.model_info()
            path = self.model_path = info.get("model_path")
        if not path:
            raise LifecycleError(
                "update_weights", "weights were released and no new weights were given, and the server "
                "reports no model_path to reload from; pass weights= to wake_up", url=self.url)
        sent = self.load_version(version)
        await self.client.update_weights_from_disk(path, weight_version=sent, flush_cache=True)
        self._loaded(sent, version)

    def _loaded(self, sent: str, version: str) -> None:
        # answers the server ended before this load may still be on their way, reporting the mark it had
        self.mark_before_load = self.mark_text
        self.mark_text, self.leased, self.version = sent, MemoryMark.decode(sent).lease is not None, version

    async def _memory_call(self, op: Literal["release", "resume"], tags: list[str]) -> None:
        """One release/resume, with the server's mark saying it is pending until it is answered."""
        await self.mark(pending=f"{op}:{','.join(tags)}")
        call = self.client.release_memory_occupation if op == "release" else self.client.resume_memory_occupation
        try:
            await call(tags)
        except EngineError as e:
            if e.status is not None:  # the server answered and refused: nothing changed
                await self.mark()
            raise
        if op == "release":
            self.released.update(tags)
        else:
            self.released.difference_update(tags)
            self.parked = False
        await self.mark()

    async def resume(self, tags: Sequence[str]) -> None:
        todo = [t for t in tags if t in self.released]
        if todo:
            await self._memory_call("resume", todo)
        elif not self.released:
            await self.mark()  # fully resident: the plain version

    async def release(self) -> None:
        todo = [t for t in self.settings.release_tags if t not in self.released]
        if todo:
            await self._memory_call("release", todo)

    async def restore_as_found(self) -> None:
        """Awake as found at attach: resume the weights, reload them from the model path under the
        version the server had, resume the rest."""
        assert self.found is not None
        reload = "weights" in self.released
        await self.resume(["weights"])
        if reload:
            await self.reload(self.found.version)
        await self.resume(sorted(self.released))
        await self.mark()

    # ------------------------------------------------------------------ generation control
    async def pause(self, mode: PauseMode) -> None:
        if self.may_be_running:  # a server holding no weights or KV cache has nothing to pause
            await self.client.pause_generation(mode)

    async def unpause(self) -> None:
        if self.may_be_running:
            await self.client.continue_generation()

    async def flush(self) -> None:
        if not self.may_be_running:
            return
        for _ in range(self.settings.flush_retries):
            if await self.client.flush_cache():
                return
            await anyio.sleep(self.settings.flush_retry_delay)
        raise LifecycleError("flush_cache", f"engine still busy after {self.settings.flush_retries} tries", url=self.url)

    # ------------------------------------------------------------------ liveness and lease
    async def probe(self) -> Mapping[str, Any]:
        """`/model_info` within the liveness timeout (never a generate)."""
        with anyio.fail_after(self.settings.liveness_timeout):
            return await self.client.model_info()

    def lost(self, info: Mapping[str, Any]) -> str | None:
        """Why the server is no longer held by this lifecycle (its mark lost our lease), or None if it is."""
        if not self.leased or "weight_version" not in info:  # (a server that reports none cannot be read back)
            return None
        reported = str(info["weight_version"])
        why = foreign_mark(reported, self.owner.lease.owner)
        if why is not None:
            self.leased, self.mark_text = False, reported
        return why

    # ------------------------------------------------------------------ attach
    async def acquire(self, info: Mapping[str, Any], *, initial: bool) -> None:
        """Take the server (its state from `info`, a `/model_info` read just now) under this lifecycle's lease.

        Refused while another live owner holds it (`Owner.check`). Two runtimes attaching at the
        same moment cannot both pass (SGLang has no compare-and-set; this is Fischer's mutual
        exclusion): each writes its lease right after reading the server free, waits
        `acquire_settle` (longer than any read-then-write may take: a slower one reads again), and
        reads the mark back; only the last writer finds its own lease there."""
        settle = self.settings.acquire_settle
        t0 = time.monotonic()
        await self.resolve(info, initial=initial)
        for attempt in range(3):
            self.mark_text = None  # (re)write the mark: our lease
            await self.mark()
            took = time.monotonic() - t0
            if not self.marks or took <= settle / 2:
                break
            if attempt == 2:
                log.warning("engine server %s: reading and marking it took %.2fs (> engine lease settle %.2fs / 2): "
                            "another runtime attaching at this very moment may not be excluded", self.url, took, settle)
                break
            t0 = time.monotonic()  # too slow to exclude anyone: read again before writing again
            self.owner.check(self.read_mark(str((await self.probe()).get("weight_version", ""))).lease, self.url)
        if not self.marks or settle <= 0:
            return
        await anyio.sleep(max(settle, 2 * took))
        info = await self.probe()
        if "weight_version" not in info:
            return
        reported = str(info["weight_version"])
        held = self.read_mark(reported).lease
        if not self.owner.is_ours(held):
            self.leased = False
            raise LifecycleError(
                "attach", "another runtime attached to this server at the same moment and holds it now ("
                + (held.describe() if held else f"its weight version was set to {reported!r}") + "); run one at a time",
                url=self.url)

    async def resolve(self, info: Mapping[str, Any], *, initial: bool) -> None:
        """Set `released` to what the server really holds, from its mark (or the configured state)."""
        reported = str(info.get("weight_version", "default"))
        mark = self.read_mark(reported)
        self.owner.check(mark.lease, self.url)
        self.mark_text = reported
        if self.model_path is None and info.get("model_path"):
            self.model_path = str(info["model_path"])
        attach_state = self.settings.attach_state
        if initial and attach_state != "auto":
            if isinstance(attach_state, list):
                released = set(attach_state)
            else:
                released = set(self.settings.release_tags) | set(mark.released) if attach_state == "asleep" else set()
        elif not self.marks:  # a server that keeps no mark and comes back: restarted (awake) or not (as left)?
            truth = await reported_released(self.client)
            if truth is None:
                raise LifecycleError(
                    "attach", "the server keeps no memory mark (it refused /update_weight_version), so whether it "
                    "was restarted (awake) or kept its released memory cannot be known; restart the runtime with "
                    "engine.attach_state set", url=self.url)
            released = truth
        elif mark.pending is not None:
            truth = await reported_released(self.client)
            if truth is None:
                op, _, text = mark.pending.partition(":")
                tags = set(text.split(","))
                done = mark.released | tags if op == "release" else mark.released - tags
                raise LifecycleError(
                    "attach", f"a runtime stopped while its /{op}_memory_occupation({sorted(tags)}) call was on the wire "
                    "(the server's weight version says so), and SGLang cannot be asked whether that call took effect: "
                    "a wrong guess crashes it. Restart the server (a fresh one is awake), or, if you know, set "
                    f"engine.attach_state: {self.as_setting(done)} if the call took effect, "
                    f"{self.as_setting(mark.released)} if it did not", url=self.url)
            released = truth
        else:
            released = set(mark.released)
        self.released = released
        if initial or self.found is None:
            self.found = MemoryMark(mark.version, frozenset(released), parked=mark.parked)
        log.info("engine server %s attached: %s", self.url,
                 f"released {sorted(released)}" if released else "awake (nothing released)")

    def as_setting(self, released: set[str] | frozenset[str]) -> str:
        """The `engine.attach_state` value that says `released`."""
        if not released:
            return "awake"
        if set(released) == set(self.settings.release_tags):
            return "asleep"
        return "[" + ", ".join(sorted(released)) + "]"
