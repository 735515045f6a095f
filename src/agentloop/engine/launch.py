"""Start, watch and stop local SGLang servers (`python -m sglang.launch_server`) as subprocesses.

Owns the server command line the runtime needs (`--enable-memory-saver` for release/resume,
`--skip-tokenizer-init` so token ids go in and out verbatim, loopback host, a free port, memory
fraction, triton attention + pytorch sampling, optional dummy weights / decode CUDA graphs / TP),
readiness, logs and shutdown. Also wraps servers that already run elsewhere (`SGLangServer.attach`).

Readiness is `/model_info` answering 200 plus, for a server we launched, SGLang's own log line
"The server is fired up and ready to roll!" (written after its warm-up generate). `/health` is never
polled here: on SGLang it runs a generate, and a generate that reaches a released server crashes it
(`docs/gpu.md`); only `Lifecycle.health` may send one, and only while AWAKE.

`write_dummy_model` writes a model folder holding only a `config.json` of a real model's shape, for
`--load-format dummy` servers (random weights, real speed and memory; benchmarks and GPU tests).

Each server runs in its own process group (SGLang forks scheduler and detokenizer processes), so
`stop()` ends all of them: SIGTERM to the group, then SIGKILL after a grace period. A launched server
is also tethered to the launching process (`agentloop.engine.tether`): if that process dies without
stopping it (SIGKILL, a timeout), the kernel kills the server, and SGLang's children follow it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Awaitable, Callable, Hashable, Mapping, Sequence, TypeVar

import anyio

from .base import EngineError
from .sglang import SGLangClient
from .tether import popen_tethered

READY_LINE = "The server is fired up and ready to roll!"


#: Qwen2.5-0.5B's shape (what the GPU tests and benchmarks serve with `--load-format dummy`).
QWEN2_05B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151643,
    "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 24,
    "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
}


def write_dummy_model(folder: str | Path, config: Mapping[str, Any] | None = None) -> Path:
    """A folder with only `config.json` (default: Qwen2.5-0.5B's shape) for `load_format="dummy"`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(config or QWEN2_05B_CONFIG), indent=1))
    return folder


class LaunchError(RuntimeError):
    """A server could not be started (exited, or not ready in time). Carries the log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class SGLangLaunchConfig:
    """What `python -m sglang.launch_server` is started with. `extra_args` go last, verbatim."""

    model_path: str
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port
    tp_size: int = 1
    mem_fraction_static: float = 0.5
    load_format: str | None = None  # "dummy": random weights from config.json alone
    cuda_graph: bool = False  # True: decode CUDA graphs (prefill graphs stay off)
    cuda_graph_max_bs: int = 64
    attention_backend: str = "triton"
    sampling_backend: str = "pytorch"
    enable_memory_saver: bool = True
    skip_tokenizer_init: bool = True
    random_seed: int | None = 0
    weight_version: str | None = None
    log_level: str = "info"
    gpu_ids: Sequence[int] | None = None  # sets CUDA_VISIBLE_DEVICES
    python: str = field(default_factory=lambda: sys.executable)
    extra_args: Sequence[str] = ()

    def argv(self, port: int) -> list[str]:
        a = [self.python, "-m", "sglang.launch_server", "--model-path", str(self.model_path),
             "--host", self.host, "--port", str(port), "--tp-size", str(self.tp_size),
             "--mem-fraction-static", str(self.mem_fraction_static),
             "--attention-backend", self.attention_backend, "--sampling-backend", self.sampling_backend,
             "--log-level", self.log_level]
        if self.enable_memory_saver:
            a.append("--enable-memory-saver")
        if self.skip_tokenizer_init:
            a.append("--skip-tokenizer-init")
        if self.load_format:
            a += ["--load-format", self.load_format]
        # sglang 0.5.17 spells "graphs off" per phase (--disable-cuda-graph is a deprecated alias).
        a += ["--cuda-graph-backend-prefill", "disabled"]
        if self.cuda_graph:
            a += ["--cuda-graph-max-bs-decode", str(self.cuda_graph_max_bs)]
        else:
            a += ["--cuda-graph-backend-decode", "disabled"]
        if self.random_seed is not None:
            a += ["--random-seed", str(self.random_seed)]
        if self.weight_version is not None:
            a += ["--weight-version", self.weight_version]
        return a + [str(x) for x in self.extra_args]


class SGLangServer:
    """One SGLang server: launched here (`SGLangServer(config)`) or already running (`attach(url)`).

    `await start()` returns the URL once ready; `await stop()` ends the whole process group (a no-op
    for attached servers). Also an async context manager.
    """

    def __init__(
        self,
        config: SGLangLaunchConfig | None = None,
        *,
        url: str | None = None,
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if (config is None) == (url is None):
            raise ValueError("give either a launch config or the URL of a running server")
        self.config = config
        self.url: str = url.rstrip("/") if url else ""
        self.log_path = Path(log_path) if log_path else None
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        self._log_file: IO[bytes] | None = None

    @classmethod
    def attach(cls, url: str) -> "SGLangServer":
        return cls(url=url)

    @property
    def launched(self) -> bool:
        return self.config is not None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def client(self, **kwargs: Any) -> SGLangClient:
        if not self.url:
            raise LaunchError("server not started: no URL yet")
        return SGLangClient(self.url, **kwargs)

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    # ------------------------------------------------------------------ lifecycle of the process
    async def start(self, timeout: float = 600.0) -> str:
        """Launch (if configured) and wait until ready; returns the URL."""
        t0 = time.monotonic()
        if self.config is not None and self.proc is None:
            cfg = self.config
            port = cfg.port or free_port(cfg.host)
            self.url = f"http://{cfg.host}:{port}"
            if self.log_path is None:
                self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang_{port}.log"
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
            if cfg.gpu_ids is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in cfg.gpu_ids)
            env.update(self.env)
            self._log_file = open(self.log_path, "wb")
            argv = cfg.argv(port)
            self._log_file.write(("$ " + " ".join(argv) + "\n").encode())
            self._log_file.flush()
            # Own process group: SGLang's scheduler/detokenizer children are stopped with it.
            self.proc = popen_tethered(argv, stdout=self._log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            await self.wait_ready(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except BaseException:
            with anyio.CancelScope(shield=True):  # a cancelled start still ends the whole group
                await self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self.url

    async def wait_ready(self, timeout: float = 600.0, poll: float = 1.0) -> None:
        """Poll `/model_info` (never `/health`) until 200 and, for a launched server, its ready line."""
        deadline = time.monotonic() + timeout
        async with SGLangClient(self.url, timeout=5.0, retries=0) as c:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise LaunchError(f"sglang server exited with code {self.proc.returncode} during start-up; "
                                      f"log {self.log_path}:\n{self.log_tail()}")
                try:
                    await c.model_info()
                    if self.proc is None or READY_LINE in self._read_log():
                        return
                except EngineError:
                    pass
                if time.monotonic() > deadline:
                    raise LaunchError(f"sglang server at {self.url} not ready after {timeout:.0f}s; "
                                      f"log {self.log_path}:\n{self.log_tail()}")
                await anyio.sleep(poll)

    def _read_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""

    async def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `timeout`; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            with anyio.move_on_after(timeout):
                while proc.poll() is None:
                    await anyio.sleep(0.2)
        # Kill what is left of the group either way: children can outlive their parent.
        self._signal_group(signal.SIGKILL)
        if proc.poll() is None:
            await anyio.to_thread.run_sync(proc.wait)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self.proc = None
        return proc.returncode

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)  # pgid == pid: started with start_new_session
        except ProcessLookupError:
            pass

    async def __aenter__(self) -> "SGLangServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


_T = TypeVar("_T")


async def start_by_gpu(items: Sequence[_T], gpus: Callable[[_T], Hashable],
                       start: Callable[[_T], Awaitable[None]]) -> list[BaseException]:
    """Start engine servers: those on different GPUs (`gpus(item)`) concurrently, those sharing a GPU one
    after another. sglang 0.5.17 sizes its KV pool as `free memory now - free memory at its start x
    (1 - mem_fraction)`, so a neighbour that allocates between those two readings leaves it nothing
    ("Loaded weights leave no GPU memory for the KV cache", seen on an H200 with two servers started
    together); started in turn, each measures the memory the ones before it left. Returns the errors:
    after the first, servers not yet begun are skipped (the other GPUs' starts run to their end)."""
    errors: list[BaseException] = []
    groups: dict[Hashable, list[_T]] = {}
    for item in items:
        groups.setdefault(gpus(item), []).append(item)

    async def in_turn(group: list[_T]) -> None:
        for item in group:
            if errors:
                return
            try:
                await start(item)
            except Exception as e:  # collected: the caller stops everything
                errors.append(e)

    async with anyio.create_task_group() as tg:
        for group in groups.values():
            tg.start_soon(in_turn, group)
    return errors


async def start_servers(servers: Sequence[SGLangServer], timeout: float = 600.0) -> list[str]:
    """Start several servers (in turn where they share a GPU, see `start_by_gpu`); stops all of them if
    one fails."""
    async def start(s: SGLangServer) -> None:
        await s.start(timeout)

    errors = await start_by_gpu(
        servers, lambda s: tuple(s.config.gpu_ids) if s.config is not None and s.config.gpu_ids is not None else None,
        start)
    if errors:
        for s in servers:
            await s.stop()
        raise errors[0]
    return [s.url for s in servers]


# ------------------------------------------------------------------ command line
def main(argv: Sequence[str] | None = None) -> int:
    """`python -m agentloop.engine.launch`: start one SGLang server, print its URL, stop it on SIGTERM/SIGINT.

    For scripts that share one server between several programs (e.g. tools/gpu_run.sh and the
    benchmarks it runs): `--ready-file` receives the URL once the server is ready.
    """
    import argparse

    p = argparse.ArgumentParser(prog="python -m agentloop.engine.launch", description=main.__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", help="a local model folder")
    src.add_argument("--dummy", metavar="FOLDER", help="write a Qwen2.5-0.5B-shaped config.json there; serve it "
                     "with --load-format dummy")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--mem-fraction", type=float, default=0.5)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cuda-graph", action="store_true", help="decode CUDA graphs on")
    p.add_argument("--log", default=None, help="server log file")
    p.add_argument("--ready-file", default=None, help="write the URL here once ready")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: flags passed to sglang.launch_server verbatim")
    a = p.parse_args(argv)
    extra = [x for x in a.extra if x != "--"]
    if a.dummy:
        cfg = SGLangLaunchConfig(model_path=str(write_dummy_model(a.dummy)), load_format="dummy", port=a.port,
                                 mem_fraction_static=a.mem_fraction, tp_size=a.tp, cuda_graph=a.cuda_graph,
                                 extra_args=extra)
    else:
        cfg = SGLangLaunchConfig(model_path=a.model_path, port=a.port, mem_fraction_static=a.mem_fraction,
                                 tp_size=a.tp, cuda_graph=a.cuda_graph, extra_args=extra)
    server = SGLangServer(cfg, log_path=a.log)

    async def serve() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            try:
                url = await server.start(timeout=a.timeout)
                print(f"READY {url} (started in {server.startup_seconds:.1f}s; log {server.log_path})", flush=True)
                if a.ready_file:
                    Path(a.ready_file).write_text(url + "\n")
                async for _ in signals:
                    break
            finally:
                with anyio.CancelScope(shield=True):
                    await server.stop()

    try:
        anyio.run(serve)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
