"""Each server's memory state, recorded in the server itself: the memory calls (release, resume,
weight loads) and the `MemoryMark` written around each one, carrying this lifecycle's lease while it
holds the server.

SGLang 0.5.17 does not report its released memory tags over HTTP, and it crashes on a release of
released memory and on a resume of resident memory. So around every release and resume the lifecycle
writes a `MemoryMark` into the server's weight version (`/update_weight_version`, which only sets a
string in SGLang's HTTP process and is safe in any memory state; weight loads carry the mark as their
`weight_version`). "pending" names a memory call sent and not yet answered. The mark dies with the
server process, so a restarted server never carries a stale one; once fully awake (and let go) the
server reports its plain weight version again. Reading marks back is `lifecycle_attach.py`'s job.
"""

from __future__ import annotations

from typing import Literal, Sequence

import anyio

from .base import EngineError
from .lease import Lease
from .lifecycle_server import TrackedServer, log
from .lifecycle_types import LifecycleError, MemoryMark, Weights

__all__ = ["MarksMixin"]


class MarksMixin:
    """The servers a `Lifecycle` drives, and the memory calls that change them, each one marked.

    The bottom of the lifecycle's layers (`lifecycle.py` puts them together): it declares the state
    they share, which `Lifecycle.__init__` sets."""

    _servers: dict[str, TrackedServer]
    release_tags: tuple[str, ...]
    reload_path: str | None
    weight_version: str | None
    lease: Lease
    lease_timeout: float
    liveness_timeout: float
    stage_timeout: float
    _holding: bool
    _transition_lock: anyio.Lock

    def _in_rotation(self) -> list[TrackedServer]:
        return [s for s in self._servers.values() if s.out is None]

    def _load_version(self, s: TrackedServer, version: str) -> str:
        """The `weight_version` a load sends: the version, marked with what is still released (and the lease)."""
        return MemoryMark(version, frozenset(s.released), lease=self._held_lease()).encode() if s.marks else version

    def _held_lease(self) -> Lease | None:
        """The lease to write now (renewed when half gone), or None once this lifecycle let go."""
        if not self._holding:
            return None
        if self.lease.due(self.lease_timeout):
            self.lease = self.lease.renewed(self.lease_timeout)
        return self.lease

    async def _reload(self, s: TrackedServer, version: str) -> None:
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

    async def _load(self, s: TrackedServer, w: Weights, version: str) -> None:
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

    async def _memory_call(self, s: TrackedServer, op: Literal["release", "resume"], tags: list[str]) -> None:
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

    async def _mark(self, s: TrackedServer, *, pending: str | None = None) -> None:
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

    async def _resume(self, s: TrackedServer, tags: Sequence[str]) -> None:
        todo = [t for t in tags if t in s.released]
        if todo:
            await self._memory_call(s, "resume", todo)
        elif not s.released:
            await self._mark(s)  # fully resident: the plain version

    async def _release(self, s: TrackedServer) -> None:
        todo = [t for t in self.release_tags if t not in s.released]
        if todo:
            await self._memory_call(s, "release", todo)
