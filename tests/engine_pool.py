"""`EnginePool`: CPU engine servers of one model and command line, reused while they are as good as new.

Starting `agentloop serve` costs seconds of CPU (torch and transformers imports, the model load), and
the fault tests would otherwise each start their own servers; tests/conftest.py's `start_local_engine`
shares them across the modules of a test session the same way. `checkout(n)` hands out `n` running
servers, each checked to be indistinguishable from a fresh start: alive and not stopped, nothing
paused, released, running, waiting or held, the weight version and model path a fresh start reports,
and greedy tokens equal to those of the pool's first, freshly started server (the weights are the base
ones). A server that fails any check is stopped and replaced by a new one, so a test never sees what an
earlier one left. Tests may kill, stop or replace the servers they got; servers they add with `adopt`
are stopped at `close` with the rest.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
from pathlib import Path
from typing import AsyncIterator

import anyio

from agentloop.engine.base import SamplingParams
from agentloop.engine.local.process import LocalEngineProcess
from agentloop.engine.sglang import SGLangClient

#: A short greedy request whose tokens identify the served weights.
PROBE_IDS, PROBE_PARAMS = [1, 2, 3, 4], SamplingParams(max_new_tokens=6, temperature=0.0)


async def greedy_tokens(url: str) -> list[int]:
    async with SGLangClient(url) as c:
        return (await c.generate(PROBE_IDS, PROBE_PARAMS)).output_ids


async def model_identity(client: SGLangClient) -> tuple[str, str]:
    """(weight version, model path): what a weight update or an owner's lease (kept in the version) changes."""
    info = await client.model_info()
    return info["weight_version"], info["model_path"]


class EnginePool:
    def __init__(self, model_dir: Path, extra_args: tuple[str, ...] = (), *, log_dir: Path | None = None) -> None:
        self.model_dir, self.extra_args, self.log_dir = model_dir, extra_args, log_dir
        self.procs: list[LocalEngineProcess] = []  # every server ever handed out or adopted, in order
        self._free: list[LocalEngineProcess] = []
        self.base_tokens: list[int] | None = None
        self.base_info: tuple[str, str] | None = None  # (weight version, model path) of a fresh start
        self.started = 0  # servers this pool started (the tests' own restarts not counted)

    def adopt(self, proc: LocalEngineProcess) -> LocalEngineProcess:
        """A server a test started itself (e.g. a restart on a freed port): stopped at close."""
        self.procs.append(proc)
        return proc

    async def _start(self) -> LocalEngineProcess:
        log_path = None if self.log_dir is None else self.log_dir / f"serve-{len(self.procs)}.log"
        proc = self.adopt(LocalEngineProcess(self.model_dir, extra_args=self.extra_args, log_path=log_path))
        await proc.start()
        self.started += 1
        return proc

    async def _as_new(self, proc: LocalEngineProcess) -> bool:
        if proc.returncode is not None or proc.pid is None:
            return False
        os.kill(proc.pid, signal.SIGCONT)  # a test may have left it SIGSTOPped
        try:
            with anyio.fail_after(10):
                async with SGLangClient(proc.url) as c:
                    (state,) = (await c.server_info())["internal_states"]
                    info = await model_identity(c)
                idle = not (state["paused"] or state["released_tags"] or state["num_running"] or state["num_waiting"]
                            or state["num_held"]) and state["weights_valid"]
                return idle and info == self.base_info and await greedy_tokens(proc.url) == self.base_tokens
        except Exception:  # noqa: BLE001 - any failure to answer like a fresh server disqualifies it
            return False

    async def checkout(self, n: int) -> list[LocalEngineProcess]:
        """`n` servers as good as new (earlier tests' servers that pass the checks, else new ones)."""
        if self.base_tokens is None:
            self._free.append(await self._start())
            self.base_tokens = await greedy_tokens(self._free[0].url)
            async with SGLangClient(self._free[0].url) as c:
                self.base_info = await model_identity(c)
        usable = [p for p in self._free if await self._as_new(p)]
        for p in self._free:
            if p not in usable:
                await p.stop()
        self._free = []
        while len(usable) < n:
            async with anyio.create_task_group() as tg:
                for _ in range(n - len(usable)):
                    tg.start_soon(self._append_started, usable)
        handed, self._free = usable[:n], usable[n:]
        return handed

    async def _append_started(self, into: list[LocalEngineProcess]) -> None:
        into.append(await self._start())

    def checkin(self, procs: list[LocalEngineProcess]) -> None:
        """Offer servers back for the next checkout (checked again then); ones a test added are adopted."""
        for p in procs:
            if p not in self.procs:
                self.adopt(p)
            if p not in self._free:
                self._free.append(p)

    @contextlib.asynccontextmanager
    async def servers(self, n: int) -> AsyncIterator[list[LocalEngineProcess]]:
        """`checkout(n)` for the block, then `checkin` of the list as the block left it."""
        procs = await self.checkout(n)
        try:
            yield procs
        finally:
            self.checkin(procs)

    @property
    def idle(self) -> int:
        """Servers checked in and not handed out again yet."""
        return len(self._free)

    async def stop_idle(self) -> None:
        """Stop the servers waiting for a next checkout (a pool no test is likely to ask again)."""
        free, self._free = self._free, []
        await _stop_all(free)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await _stop_all(self.procs)

    def close_sync(self) -> None:
        """`close` from a fixture's teardown (a fresh loop in a helper thread: none may be running here)."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(anyio.run, self.close).result()


async def _stop_all(procs: list[LocalEngineProcess]) -> None:
    for p in procs:
        if p.returncode is None and p.pid is not None:
            os.kill(p.pid, signal.SIGCONT)  # a stopped process would not act on SIGTERM
        await p.stop()

