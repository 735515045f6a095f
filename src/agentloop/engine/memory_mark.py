"""The memory mark: a server's memory state (and its owner's lease) written into its own weight version.

The one owner of the format: `MemoryMark.encode` writes it, `MemoryMark.decode` reads it,
`served_version` strips it. Nothing else in agentloop parses a weight version. The format is
documented in docs/memory_mark.md; in short:

    VERSION~agentloop:fmt=1;released=TAG,TAG[;pending=OP:TAG,TAG][;parked=1][;owner=H:P:N;node=N;started=T;until=U]

- `VERSION` is the weight version the server serves (what every trainer-facing place shows).
- `fmt` is the format's version. A mark without it was written before the field existed and reads as
  format 1 (same fields). A mark of a higher format than `MARK_FORMAT` was written by a newer
  agentloop: `decode` refuses it (`MarkFormatError`) instead of guessing at its memory state, because
  a wrong guess crashes SGLang (a release of released memory).
- A plain version (no separator) is format-free: nothing released, nobody holds the server.

Why the weight version: SGLang 0.5.17 cannot be asked which memory tags it has released, and a
release of released memory or a resume of resident memory crashes it; the state must outlive the
runtime that wrote it (a killed runtime's successor reads it back), and the server process itself is
the one place that dies exactly when that state stops being true (a restarted server is awake and
carries no mark). `/update_weight_version` only sets a string in SGLang's HTTP process and is safe in
any memory state; weight loads carry the mark as their `weight_version`. The price: a generate
response carries the whole string, so the gate strips it (`served_version`) before anyone sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .lease import Lease

__all__ = ["MARK_FORMAT", "MARK_SEPARATOR", "AnswerCheck", "MarkFormatError", "MemoryMark", "foreign_mark",
           "served_version"]

MARK_SEPARATOR = "~agentloop:"
"""Separates the served weight version from the memory state the lifecycle records in it."""

MARK_FORMAT = 1
"""The mark format this agentloop writes and the highest it reads (docs/memory_mark.md)."""


class MarkFormatError(ValueError):
    """A mark written in a format this agentloop does not know (a newer agentloop wrote it)."""


@dataclass(frozen=True)
class MemoryMark:
    """A server's memory state as the lifecycle records it in the server's own `weight_version`.

    Before and after every release/resume the lifecycle writes this mark with `/update_weight_version`
    (and passes it as the `weight_version` of weight loads), and a later runtime reads it back from
    `/model_info`. `pending` names a call that was sent but not (yet) answered
    ("release:weights,kv_cache"): a runtime killed during it leaves it. `parked`: a runtime left the
    server asleep on purpose when it stopped (`engine.restore_on_stop: false`); without it, a server
    found asleep was left so by a runtime that did not get to stop. `lease`: the runtime that drives
    the server now (`agentloop.engine.lease`), present from its attach until it lets the server go,
    awake or asleep. A plain version (no mark) means nothing is released and nobody holds the server.
    """

    version: str
    released: frozenset[str] = frozenset()
    pending: str | None = None
    parked: bool = False
    lease: Lease | None = None

    def encode(self) -> str:
        if not self.released and self.pending is None and self.lease is None:
            return self.version
        text = f"{self.version}{MARK_SEPARATOR}fmt={MARK_FORMAT};released={','.join(sorted(self.released))}"
        text += (f";pending={self.pending}" if self.pending else "") + (";parked=1" if self.parked else "")
        return text + "".join(f";{k}={v}" for k, v in (self.lease.fields().items() if self.lease else ()))

    @classmethod
    def decode(cls, weight_version: str) -> "MemoryMark":
        """Read a weight version back; raises `MarkFormatError` for a format newer than `MARK_FORMAT`."""
        version, sep, rest = str(weight_version).partition(MARK_SEPARATOR)
        if not sep:
            return cls(version)
        fields = dict(part.partition("=")[::2] for part in rest.split(";") if part)
        fmt = fields.get("fmt", "1")  # marks written before the field existed are format 1
        if not fmt.isdigit() or int(fmt) > MARK_FORMAT:
            raise MarkFormatError(
                f"the weight version {weight_version!r} carries a memory mark of format {fmt!r}; this agentloop "
                f"reads formats up to {MARK_FORMAT} (a newer agentloop wrote it: upgrade, or restart the server)")
        released = frozenset(t for t in fields.get("released", "").split(",") if t)
        return cls(version, released, fields.get("pending") or None, fields.get("parked") == "1",
                   Lease.from_fields(fields))


def served_version(weight_version: str) -> str:
    """The weight version a server serves, without the lifecycle's mark (generate responses and
    `/model_info` carry the server's whole weight version string, mark included, while a runtime holds
    the server). Every place a user or trainer sees a version shows this."""
    return str(weight_version).partition(MARK_SEPARATOR)[0]


def foreign_mark(reported: str, owner: str) -> str | None:
    """Why the weight version `reported` (a server's, read back or in a generate answer) says the server
    is not held by the runtime whose lease owner is `owner`; None when it is. A plain version means
    the server's mark is gone (it restarted, or someone else set its version)."""
    try:
        lease = MemoryMark.decode(reported).lease
    except MarkFormatError as e:
        return f"its weight version was overwritten by a newer agentloop ({e})"
    if lease is not None and lease.owner == owner:
        return None
    if lease is not None:
        return f"taken over by {lease.describe()}"
    return (f"no longer held by this runtime: its weight version was set to {reported!r} by someone else "
            "(the server restarted, or another client wrote it)")


@dataclass(frozen=True)
class AnswerCheck:
    """A gate's `check_answer` for a process that does not drive the servers (a Ray rollout worker):
    the driver's lease owner and the servers it held with a lease when the check was made. An answer
    from one of those whose weight version carries no lease of that owner was not sampled by weights
    the driver loaded (the server restarted, or another runtime took it): the gate drops it and takes
    the server out. Plain data, so it travels to the worker process; the driver's own gate asks
    `Fleet.answer_lost`, which also updates the driver's record of the server."""

    owner: str
    leased: frozenset[str] = field(default_factory=frozenset)

    def __call__(self, url: str, weight_version: str) -> str | None:
        if url not in self.leased:
            return None
        return foreign_mark(weight_version, self.owner)
