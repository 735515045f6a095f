"""One runtime at a time: the owner-lease side of the lifecycle (`agentloop.engine.lease` is the lease).

From `attach()` until it lets the servers go (`restore` / `park`, or `close`), every mark a lifecycle
writes — awake or asleep — carries its `Lease` (owner `HOST:PID:NONCE`, the machine's boot/PID-
namespace id, the owner process's start time, an expiry `lease_timeout` ahead, renewed at every
wake-up and sleep and, during a rollout, by `keep_lease`; not between steps, the trainer's time). A
runtime attaching to a server whose lease another *live* owner holds is refused with a
`LifecycleError` naming the owner and `engine.takeover` (mid-step, its start-up sleep would abort the
owner's requests and release memory under it, and the owner's next release would crash SGLang). Live
means: on the same machine, the owner's process exists with the recorded start time (and, in this
very process, its `Lifecycle` is not closed) — so a SIGKILLed owner is taken over at once; on
another machine, the lease has not expired. `engine.takeover` (`takeover=True`) takes the server
anyway. Two runtimes attaching at the same moment cannot both win: each writes its lease, waits
`acquire_settle`, and reads it back (Fischer's mutual exclusion, `lifecycle_attach.py`; SGLang has no
compare-and-set). The owner checks its lease in every liveness probe (`_lost`): a server whose mark
names someone else is taken out of its rotation at once, before any memory call, and never touched
again while that owner lives (so a takeover never causes a double release); a server whose mark lost
every lease (restarted, or let go) is re-admitted at the next wake-up in its real state. Generate
responses carry the server's whole weight version, so the gate strips the mark (`served_version`):
trajectories record the plain version. Servers that keep no mark (no `/update_weight_version`) get no
lease, and are not protected.
"""

from __future__ import annotations

from typing import Any, Mapping

import anyio

from .lease import owner_status, unregister
from .lifecycle_marks import MarksMixin
from .lifecycle_server import PROBE_ERRORS, TrackedServer, log, short_error
from .lifecycle_types import LifecycleError, MemoryMark

__all__ = ["OwnerMixin"]


class OwnerMixin(MarksMixin):
    """Whether a server is ours to drive (refusing live owners, noticing a lost lease), keeping the
    lease alive during a rollout, and letting the servers go."""

    takeover: bool

    def _check_lease(self, s: TrackedServer, mark: MemoryMark) -> None:
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

    def _lost(self, s: TrackedServer, info: Mapping[str, Any]) -> str | None:
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

    async def _let_go(self) -> None:
        """Stop holding the servers: their marks lose this lifecycle's lease (a server woken
        completely reports its plain weight version again), then `close`."""
        self._holding = False
        for s in self._in_rotation():
            if s.leased or s.parked:
                try:
                    await self._mark(s)
                except PROBE_ERRORS as e:  # unreachable: its lease lapses when this process ends
                    log.warning("engine server %s: could not clear this runtime's lease (%s)", s.url, short_error(e))
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
                    except (*PROBE_ERRORS, LifecycleError) as e:
                        log.warning("engine server %s: could not renew this runtime's lease (%s)", s.url, short_error(e))

    def close(self) -> None:
        """This lifecycle drives nothing from now on: its lease, wherever a server still carries it,
        belongs to a dead owner (another runtime takes the server over at once). `restore` and
        `park` call it; call it yourself for a lifecycle abandoned without either."""
        self._holding = False
        unregister(self.lease)
