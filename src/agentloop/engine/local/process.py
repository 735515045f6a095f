"""`LocalEngineProcess`: run `agentloop serve` as a subprocess on a free loopback port.

Starts `python -m agentloop.cli serve --model DIR --host H --port P ...`, writes its output to a log
file, and waits until `GET /model_info` answers (a non-generating probe, safe in any memory state).
If the process dies or the timeout passes first, the error carries the tail of the log. `stop()`
sends SIGTERM, then SIGKILL after a grace period. Usable as an async context manager.

The process is tethered to the one that starts it (`agentloop.engine.tether`): if that one dies
without stopping it (SIGKILL, a timeout), the kernel kills the server too, freeing its port.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import aiohttp

from ..tether import popen_tethered


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EngineStartError(RuntimeError):
    """The engine subprocess did not become ready; the message includes its log tail."""


class LocalEngineProcess:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.host = host
        self.port = port or free_port(host)
        self.extra_args = list(extra_args)
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="agentloop-serve-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "agentloop.cli", "serve",
            "--model", str(self.model_dir), "--host", self.host, "--port", str(self.port),
            *self.extra_args,
        ]

    async def start(self, timeout: float = 120.0) -> str:
        """Launch and wait for readiness; returns the URL."""
        if self._proc is not None:
            raise RuntimeError("LocalEngineProcess already started")
        with open(self.log_path, "wb") as log:
            self._proc = popen_tethered(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                if self._proc.poll() is not None:
                    raise EngineStartError(
                        f"agentloop serve exited with code {self._proc.returncode} before it was ready "
                        f"(log {self.log_path}):\n{self.log_tail()}"
                    )
                try:
                    async with session.get(f"{self.url}/model_info", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return self.url
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    await self.stop()
                    raise EngineStartError(
                        f"agentloop serve not ready after {timeout:.0f}s at {self.url} (log {self.log_path}):\n{self.log_tail()}"
                    )
                await asyncio.sleep(0.2)

    async def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, wait up to `grace` seconds, then SIGKILL. Returns the exit code."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)
        return proc.returncode

    async def __aenter__(self) -> "LocalEngineProcess":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
