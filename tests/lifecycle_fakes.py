"""Small in-memory engine and gate doubles for the lifecycle's unit tests (driver, fleet).

`MemEngine` enforces SGLang's memory rules that the lifecycle exists to respect (a release of
released memory or a resume of resident memory fails, as it crashes SGLang) and records every call;
`RecordingGates` is a `GateControl` that records what the fleet tells it."""

from __future__ import annotations

from typing import Any, Sequence

from agentloop.engine.base import EngineError


class MemEngine:
    def __init__(self, url: str, *, version: str = "default", released: Sequence[str] = ()) -> None:
        self.url = url
        self.weight_version = version
        self.released = set(released)
        self.calls: list[tuple[str, Any]] = []
        self.fail: dict[str, Exception] = {}
        self.report_released = False
        self.paused: str | None = None

    def _call(self, op: str, arg: Any = None) -> None:
        self.calls.append((op, arg))
        if op in self.fail:
            raise self.fail.pop(op)

    async def model_info(self) -> dict[str, Any]:
        self._call("model_info")
        return {"model_path": "/models/m", "weight_version": self.weight_version}

    async def server_info(self) -> dict[str, Any]:
        return {"released_tags": sorted(self.released)} if self.report_released else {}

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None:
        self._call("version", new_version)
        self.weight_version = new_version

    async def release_memory_occupation(self, tags: Sequence[str]) -> None:
        self._call("release", tuple(tags))
        if set(tags) & self.released:
            raise EngineError("/release_memory_occupation", 400, "Cannot pause allocation that is not active", url=self.url)
        self.released.update(tags)

    async def resume_memory_occupation(self, tags: Sequence[str]) -> None:
        self._call("resume", tuple(tags))
        if set(tags) - self.released:
            raise EngineError("/resume_memory_occupation", 400, "KeyError", url=self.url)
        self.released.difference_update(tags)

    async def update_weights_from_tensor(self, named, *, load_format=None, weight_version=None, flush_cache=True,
                                         abort_all_requests=False) -> None:
        self._call("update_tensor", flush_cache)
        if "weights" in self.released:
            raise EngineError("/update_weights_from_tensor", 400, "weights released", url=self.url)
        self.weight_version = weight_version or self.weight_version

    async def update_weights_from_disk(self, path, *, load_format=None, weight_version=None, flush_cache=True,
                                       abort_all_requests=False) -> None:
        self._call("update_disk", path)
        self.weight_version = weight_version or self.weight_version

    async def pause_generation(self, mode: str = "abort") -> None:
        self._call("pause", mode)
        self.paused = mode

    async def continue_generation(self) -> None:
        self._call("continue")
        self.paused = None

    async def flush_cache(self) -> bool:
        self._call("flush")
        return True

    def ops(self) -> list[str]:
        return [op for op, _ in self.calls if op != "model_info"]


class RecordingGates:
    """A `GateControl` recording each call (a second gate beside the fleet's own, as Ray's pool is)."""

    def __init__(self, in_flight: int = 0) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.left = in_flight

    async def open(self, weight_version: str | None) -> None:
        self.calls.append(("open", weight_version))

    async def close(self, *, for_update: bool = False) -> int:
        self.calls.append(("close", "for_update" if for_update else None))
        return 0

    async def mark_sleeping(self) -> None:
        self.calls.append(("mark_sleeping", None))

    async def wait_settled(self, url: str, timeout: float) -> int:
        self.calls.append(("wait_settled", url))
        return self.left

    async def take_out(self, url: str, reason: str) -> None:
        self.calls.append(("take_out", url))

    async def admit(self, url: str) -> None:
        self.calls.append(("admit", url))
