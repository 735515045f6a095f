"""One runtime at a time: the owner lease a lifecycle holds on its servers (`agentloop.engine.lease` is
the lease itself, `engine/memory_mark.py` where it is written).

From `attach()` until it lets the servers go (`restore` / `park`, or `close`), every mark a lifecycle
writes — awake or asleep — carries its `Lease` (owner `HOST:PID:NONCE`, the machine's boot/PID-
namespace id, the owner process's start time, an expiry `lease_timeout` ahead, renewed at every
wake-up and sleep and, during a rollout, by `Lifecycle.keep_lease`; not between steps, the trainer's
time). A runtime attaching to a server whose lease another *live* owner holds is refused with a
`LifecycleError` naming the owner and `engine.takeover` (mid-step, its start-up sleep would abort the
owner's requests and release memory under it, and the owner's next release would crash SGLang). Live
means: on the same machine, the owner's process exists with the recorded start time (and, in this
very process, its `Lifecycle` is not closed) — so a SIGKILLed owner is taken over at once; on
another machine, the lease has not expired. `engine.takeover` takes the server anyway. Two runtimes
attaching at the same moment cannot both win (`ServerDriver.acquire`: Fischer's mutual exclusion;
SGLang has no compare-and-set). The owner checks its lease in every liveness probe
(`ServerDriver.lost`): a server whose mark names someone else is taken out of rotation at once, before
any memory call, and never touched again while that owner lives (so a takeover never causes a double
release); a server whose mark lost every lease (restarted, or let go) is re-admitted at the next
wake-up in its real state. Servers that keep no mark (no `/update_weight_version`) get no lease, and
are not protected.
"""

from __future__ import annotations

from ..lease import Lease, new_lease, owner_status, register, unregister
from .log import log
from .types import LifecycleError

__all__ = ["Owner"]


class Owner:
    """This lifecycle's claim on its servers: the lease to write (renewed when half gone) while it
    holds them, and the judgement of another runtime's lease found in a server's mark."""

    def __init__(self, holder: object, *, lease_timeout: float, takeover: bool) -> None:
        self.lease_timeout = lease_timeout
        self.takeover = takeover
        #: this lifecycle's claim, written into its servers' marks until it lets them go
        self.lease: Lease = new_lease(lease_timeout)
        self.holding = True
        # `holder` (the Lifecycle) being alive is what "alive" means for a lease of this process
        register(self.lease, holder)

    def held_lease(self) -> Lease | None:
        """The lease to write now (renewed when half gone), or None once this lifecycle let go."""
        if not self.holding:
            return None
        if self.lease.due(self.lease_timeout):
            self.lease = self.lease.renewed(self.lease_timeout)
        return self.lease

    def is_ours(self, lease: Lease | None) -> bool:
        return lease is not None and lease.owner == self.lease.owner

    def check(self, lease: Lease | None, url: str) -> None:
        """Refuse a server another runtime drives now; say so when a dead or expired one is taken over."""
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
                url=url)
        why = {"dead": "its process is gone", "expired": "its lease expired"}.get(status, "engine.takeover is set")
        log.warning("engine server %s: taking it over from %s: %s", url, lease.describe(), why)

    def close(self) -> None:
        """Hold nothing from now on: the lease, wherever a server still carries it, belongs to a dead
        owner (another runtime takes the server over at once)."""
        self.holding = False
        unregister(self.lease)
