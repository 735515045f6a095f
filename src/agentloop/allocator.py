"""One job: pin glibc malloc's mmap and trim thresholds (`tune_allocator`), so that big transient
buffers are given back to the system instead of fragmenting the heap.

glibc serves an allocation above its *mmap threshold* (128 KiB at start) with its own `mmap`, and
`munmap`s it when freed. But the threshold is dynamic: freeing such a chunk raises it to that chunk's
size (up to 32 MiB), so after one big buffer is freed — a 10 MB tool output, a 60 MiB request body —
later multi-MB buffers come from the heap, where they fragment it between long-lived small objects
and are never returned: RSS ratchets up (the hostile soak grew 365 → 651 MB with glibc's defaults,
`benchmarks/results/soak_cpu_hostile_default_malloc.json`). Setting the thresholds with `mallopt`
fixes them (and turns the dynamic adjustment off): `M_MMAP_THRESHOLD` = 128 KiB keeps every large
buffer mmapped, `M_TRIM_THRESHOLD` = 128 KiB gives free memory at the heap's top back promptly.

Called where agentloop owns the process and runs no model in it: the CLI's `rollout` and `bench`
commands (`agentloop.cli`), the tool worker process (`tools.worker_main.main`) and the Ray rollout
worker actor (`distributed.worker.RolloutWorker`). Not by `Runtime.start`: a trainer that embeds the
runtime owns its process, and pinned thresholds slow torch's CPU work there
(`benchmarks/allocator_training.py`, `benchmarks/results/allocator_training_cpu.json`: a small Qwen2's
training iterations about 1.36× slower); such a trainer may call `tune_allocator()` itself when its big
buffers are on the GPU. Not by `agentloop serve` (the CPU engine's server), whose forward passes run in
its own process for the same reason (an earlier `benchmarks/serve_threads.py` run, not committed, saw
its tokens/s drop by about half). The likely cause, not traced: a forward or backward pass allocates
and frees tensors of hundreds of KiB to MiBs, which then become an `mmap`/`munmap` pair with fresh page
faults each time.

The operator wins: a threshold set through glibc's environment (`MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_`, note the trailing underscore, or `GLIBC_TUNABLES` with
`glibc.malloc.mmap_threshold` / `glibc.malloc.trim_threshold`) is left as it is. Off glibc (musl,
macOS, Windows) this does nothing. Idempotent: the first call's record is returned again.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["AllocatorTuning", "tune_allocator", "THRESHOLD_BYTES"]

#: The mmap and trim thresholds set (glibc's own initial mmap threshold, then held there).
THRESHOLD_BYTES = 128 * 1024

# mallopt parameters (malloc.h): name -> (param, glibc env variable, GLIBC_TUNABLES name).
_KNOBS: dict[str, tuple[int, str, str]] = {
    "mmap_threshold": (-3, "MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),  # M_MMAP_THRESHOLD
    "trim_threshold": (-1, "MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold"),  # M_TRIM_THRESHOLD
}


@dataclass(frozen=True)
class AllocatorTuning:
    """What `tune_allocator` did: `applied` if it set at least one threshold; `set` the thresholds it set
    (name -> bytes); `left` the ones the operator's environment sets (name -> where); `reason` in words."""

    applied: bool
    reason: str
    set: dict[str, int] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)


_lock = threading.Lock()
_done: AllocatorTuning | None = None


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (it exports `gnu_get_libc_version` and `mallopt`)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError, TypeError):  # TypeError: CDLL(None) on Windows
        return None
    return libc


def _operator_setting(knob: str, env: Mapping[str, str]) -> str | None:
    """Where the environment sets `knob` for glibc, or None."""
    _, variable, tunable = _KNOBS[knob]
    if env.get(variable, "") != "":
        return variable
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        if item.split("=", 1)[0].strip() == tunable:
            return "GLIBC_TUNABLES"
    return None


def tune_allocator(env: Mapping[str, str] | None = None) -> AllocatorTuning:
    """Pin glibc's mmap and trim thresholds to `THRESHOLD_BYTES` unless the environment sets them (see
    the module docstring). Once per process: later calls return the first call's record."""
    global _done
    with _lock:
        if _done is not None:
            return _done
        _done = _tune(os.environ if env is None else env)
        return _done


def _tune(env: Mapping[str, str]) -> AllocatorTuning:
    libc = _glibc()
    if libc is None:
        return AllocatorTuning(False, "not glibc: nothing to tune")
    left = {k: where for k in _KNOBS if (where := _operator_setting(k, env)) is not None}
    done: dict[str, int] = {}
    failed = []
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    for knob, (param, _, _) in _KNOBS.items():
        if knob in left:
            continue
        if libc.mallopt(param, THRESHOLD_BYTES) == 1:
            done[knob] = THRESHOLD_BYTES
        else:
            failed.append(knob)
    parts = [f"{k} = {v} bytes" for k, v in done.items()]
    parts += [f"{k} left to {where}" for k, where in left.items()]
    parts += [f"mallopt refused {k}" for k in failed]
    return AllocatorTuning(bool(done), "; ".join(parts), done, left)
