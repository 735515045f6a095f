"""Where a runtime's engines come from: one strategy object per kind, chosen from config.

- `GivenClients`: `EngineClient`s handed to `Runtime(clients=...)`; attached, never stopped.
- `UrlEngines`: running servers at `engine.urls`; attached.
- `EmbeddedEngines`: `engine.num_local_servers` CPU engines (`agentloop serve` subprocesses) on
  `engine.model` (or the shipped tiny tool model); started and stopped by the runtime.
- `LaunchedEngines`: the `engine.launch` SGLang servers, one per GPU id; started and stopped.
- In Ray mode, `agentloop.distributed.engines.RayFleetEngines`: the last two as Ray actors.

`engine_backend(config, clients)` picks one for a local runtime. A backend's `start(stack)` returns
the clients and registers its own teardown on the runtime's exit stack (clients closed, then what it
started stopped; processes are recorded *before* they start, so a failure part-way still stops them);
`model_path` is the folder the engines load (for the tokenizer and reloads; None when attached);
`processes` lists what it started (empty: the runtime attached to servers it leaves as it found them).
How each is obtained (processes, clients) is `runtime.engines`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Protocol, Sequence

import anyio

from ..config.settings import EngineConfig, RuntimeConfig
from ..engine.base import EngineClient
from .assembly import on_teardown
from .engines import embedded_model, launch_sglang, make_client, start_embedded

log = logging.getLogger(__name__)

__all__ = ["EmbeddedEngines", "EngineBackend", "GivenClients", "LaunchedEngines", "UrlEngines", "close_and_stop",
           "engine_backend"]


class EngineBackend(Protocol):
    """How a runtime obtains its engines (see the module docstring)."""

    model_path: str | None
    processes: list[Any]

    async def start(self, stack: contextlib.AsyncExitStack) -> list[EngineClient]: ...


def engine_backend(config: RuntimeConfig, clients: Sequence[EngineClient] | None = None) -> EngineBackend:
    """The backend `engine.mode` names (`clients` given: those)."""
    ecfg = config.engine
    if clients is not None:
        return GivenClients(clients)
    if ecfg.mode == "urls":
        return UrlEngines(ecfg)
    if ecfg.mode == "launch":
        return LaunchedEngines(ecfg)
    return EmbeddedEngines(ecfg)


def close_and_stop(stack: contextlib.AsyncExitStack, clients: list[EngineClient], processes: list[Any]) -> None:
    """Register the teardown of `clients` (closed) and then `processes` (stopped, last started first)."""

    async def stop() -> None:
        for c in clients:
            with contextlib.suppress(Exception):
                await c.close()
        for p in reversed(processes):
            try:
                with anyio.fail_after(60):
                    await p.stop()
            except Exception as e:  # keep stopping the others; say which one failed
                log.error("stopping engine %r failed: %s", getattr(p, "url", p), e)
        processes.clear()

    on_teardown(stack, "stopping the engines", stop)


class GivenClients:
    """Clients the caller made; the runtime closes them at stop but never stops their servers."""

    def __init__(self, clients: Sequence[EngineClient]) -> None:
        self.clients = list(clients)
        self.model_path: str | None = None
        self.processes: list[Any] = []

    async def start(self, stack: contextlib.AsyncExitStack) -> list[EngineClient]:
        clients = list(self.clients)
        close_and_stop(stack, clients, self.processes)
        return clients


class UrlEngines:
    """Running servers at `engine.urls` (SGLang or CPU engines); attached."""

    def __init__(self, ecfg: EngineConfig) -> None:
        self.ecfg = ecfg
        self.model_path: str | None = None
        self.processes: list[Any] = []

    async def start(self, stack: contextlib.AsyncExitStack) -> list[EngineClient]:
        clients = [make_client(u, self.ecfg) for u in self.ecfg.urls]
        close_and_stop(stack, clients, self.processes)
        return clients


class EmbeddedEngines:
    """CPU engine subprocesses on `engine.model` (default: the shipped tiny tool model)."""

    def __init__(self, ecfg: EngineConfig) -> None:
        self.ecfg = ecfg
        self.model_path: str | None = None
        self.processes: list[Any] = []

    async def start(self, stack: contextlib.AsyncExitStack) -> list[EngineClient]:
        clients: list[EngineClient] = []
        close_and_stop(stack, clients, self.processes)
        model = embedded_model(self.ecfg)
        self.model_path = str(model)
        urls = await start_embedded(self.ecfg, model, self.processes)
        clients.extend(make_client(u, self.ecfg) for u in urls)
        return clients


class LaunchedEngines:
    """`sglang.launch_server` processes from `engine.launch`, one per GPU id."""

    def __init__(self, ecfg: EngineConfig) -> None:
        assert ecfg.launch is not None
        self.ecfg = ecfg
        self.model_path: str | None = ecfg.launch.model_path
        self.processes: list[Any] = []

    async def start(self, stack: contextlib.AsyncExitStack) -> list[EngineClient]:
        clients: list[EngineClient] = []
        close_and_stop(stack, clients, self.processes)
        urls = await launch_sglang(self.ecfg, self.processes)
        clients.extend(make_client(u, self.ecfg) for u in urls)
        return clients
