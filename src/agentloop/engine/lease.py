"""Owner leases: which runtime drives an engine server now, recorded in the server's own mark.

Two runtimes driving one server break each other: the second one's start-up sleep aborts the first
one's requests and releases memory under it, and the first one's next sleep then releases released
memory, which crashes SGLang. So a `Lifecycle` holding a server writes a `Lease` into the server's
`MemoryMark` (the weight version, `engine/memory_mark.py`) from `attach` until it lets the
server go (`restore`/`park` at stop), and a runtime attaching to a server whose lease is held by a
live owner is refused (`LeaseHeld`).

Who is alive (`owner_status`):

- **same machine** (same boot id and PID namespace, so the owner's pid means the same process here):
  exact — the owner's process must exist, not be a zombie, and have the start time the lease
  records (a reused pid does not count); inside one process, the owning `Lifecycle` must not have
  been closed or garbage-collected (`register`/`unregister`). A SIGKILLed owner is taken over at once.
- **another machine**: the lease's expiry (`until`, wall clock); the owner renews it at every wake-up
  and sleep and during rollouts (`Lifecycle.keep_lease`), `lease_timeout` ahead. A dead owner there
  is taken over once it expires, or at once with `engine.takeover: true`. Between steps (the
  trainer's time) nothing renews it: if that gap outlasts the lease, a runtime on another machine
  may take the server, and the owner's next wake-up finds the other lease and stops driving it
  (a clear error, never a double release). Set `engine.lease_timeout` above that gap when runtimes
  on several machines share servers.

The lease is `owner=HOST:PID:NONCE;node=NODE;started=TICKS;until=UNIX` inside the mark.
"""

from __future__ import annotations

import gc
import hashlib
import os
import secrets
import socket
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Mapping

__all__ = ["Lease", "OwnerStatus", "new_lease", "owner_status", "register", "unregister"]

OwnerStatus = Literal["ours", "alive", "dead", "expired", "unknown"]

_live: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


def _proc_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (/proc/PID/stat field 22); None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def _node_id() -> str:
    """Same value <=> same kernel boot and PID namespace: where a pid names the same process."""
    parts = []
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        parts.append(socket.gethostname())
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append(str(os.getpid()))  # unknown namespace: match nobody else
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def _host() -> str:
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname()) or "host"


@dataclass(frozen=True)
class Lease:
    """Who holds a server (`owner` = HOST:PID:NONCE), where its pid means something, and until when."""

    owner: str
    node: str
    started: int
    until: int

    @property
    def pid(self) -> int:
        return int(self.owner.split(":")[1])

    @property
    def nonce(self) -> str:
        return self.owner.rsplit(":", 1)[-1]

    def renewed(self, timeout: float) -> "Lease":
        return replace(self, until=int(time.time() + timeout) + 1)

    def due(self, timeout: float) -> bool:
        """Half its time is gone: renew at the next mark written."""
        return self.until - time.time() < timeout / 2

    def fields(self) -> dict[str, str]:
        return {"owner": self.owner, "node": self.node, "started": str(self.started), "until": str(self.until)}

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> "Lease | None":
        owner = fields.get("owner")
        if not owner or owner.count(":") != 2:
            return None
        try:
            return cls(owner, fields.get("node", ""), int(fields.get("started") or 0), int(fields.get("until") or 0))
        except ValueError:
            return None

    def describe(self) -> str:
        host, pid, nonce = self.owner.split(":")
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.until))
        return f"agentloop runtime {nonce} in process {pid} on {host} (lease " + (
            f"until {when})" if self.until > time.time() else f"expired at {when})")


def new_lease(timeout: float) -> Lease:
    """A lease for a new holder in this process (a fresh nonce), valid `timeout` seconds."""
    pid = os.getpid()
    return Lease(f"{_host()}:{pid}:{secrets.token_hex(4)}", _node_id(), _proc_start_ticks(pid) or 0,
                 0).renewed(timeout)


def register(lease: Lease, holder: object) -> None:
    """`holder` (a Lifecycle) holds `lease` while it exists and until `unregister`."""
    _live[lease.nonce] = holder


def unregister(lease: Lease) -> None:
    _live.pop(lease.nonce, None)


def owner_status(lease: Lease, mine: Lease) -> OwnerStatus:
    """Whether `lease`'s owner is us, alive, dead, expired (another machine), or unknown (another
    machine, not expired yet: taken to be alive)."""
    if lease.owner == mine.owner:
        return "ours"
    if lease.node == mine.node and mine.node:
        if lease.pid == os.getpid() and lease.started == mine.started:
            if lease.nonce in _live:
                gc.collect()  # a dropped Lifecycle sits in a reference cycle (its gate's hooks) until collected
            return "alive" if lease.nonce in _live else "dead"
        started = _proc_start_ticks(lease.pid)
        return "alive" if started is not None and started == lease.started else "dead"
    return "expired" if lease.until < time.time() else "unknown"
