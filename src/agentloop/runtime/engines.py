"""How a `Runtime` obtains its engines, and what it learns from them before the first step.

This module owns engine provisioning, nothing else, as plain functions over the runtime's config:

- **clients**: `make_client` (an `SGLangClient` for a URL, with the configured request timeout);
- **embedded CPU engine**: `embedded_model` (the configured folder or the shipped tiny tool model) and
  `start_embedded` (`agentloop serve` subprocesses, started concurrently by `start_all`);
- **launched SGLang servers**: `launch_sglang` (one server per GPU id, through `agentloop.engine.launch`);
- **tokenizer**: `load_tokenizer` (a configured path, the model folder, or the servers' `model_info()`);
- **context budget**: `reported_context_length` / `fit_context_to_engines` lower
  `agent.max_context_tokens` to the smallest usable context the engines report.

Functions that start processes append them to the caller's `processes` list *before* starting them,
so a failure part-way still leaves every process with its owner to stop. The step itself (wake →
schedule → collate → sleep) lives in `agentloop.runtime`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import anyio

from ..config.settings import EngineConfig, RuntimeConfig
from ..engine.base import EngineClient, EngineError
from .types import AgentloopError

log = logging.getLogger(__name__)

__all__ = [
    "embedded_model", "fit_context_to_engines", "launch_sglang", "load_tokenizer",
    "make_client", "reported_context_length", "start_all", "start_embedded",
]


def make_client(url: str, ecfg: EngineConfig) -> EngineClient:
    """The HTTP client for the engine at `url` (real SGLang and the CPU engine alike)."""
    from ..engine.sglang import SGLangClient

    return SGLangClient(url, generate_timeout=ecfg.request_timeout, keepalive_timeout=ecfg.keepalive_timeout,
                        check_finite_weights=ecfg.check_finite_weights)


def embedded_model(ecfg: EngineConfig) -> Path:
    """The embedded engine's model folder (`engine.model`, else the shipped tiny tool model)."""
    if ecfg.model is not None:
        model = Path(ecfg.model)
    else:
        from ..models import tiny_tool_model

        model = tiny_tool_model()
    if not model.is_dir():
        raise AgentloopError(f"engine.model: {model} is not a model folder")
    return model


async def start_embedded(ecfg: EngineConfig, model: Path, processes: list[Any]) -> list[str]:
    """Start `engine.num_local_servers` CPU engines on `model`; their URLs in order."""
    from ..engine.local.process import LocalEngineProcess

    procs = [LocalEngineProcess(model, extra_args=tuple(ecfg.local.serve_args())) for _ in range(ecfg.num_local_servers)]
    processes.extend(procs)
    return await start_all(procs, ecfg.start_timeout)


async def launch_sglang(ecfg: EngineConfig, processes: list[Any]) -> list[str]:
    """Launch the `engine.launch` SGLang servers, one per GPU id; their URLs in order."""
    from ..engine.launch import SGLangLaunchConfig, SGLangServer, start_servers

    lc = ecfg.launch
    assert lc is not None
    gpu_ids = lc.gpu_ids or list(range(lc.num_servers))
    if len(gpu_ids) != lc.num_servers:
        raise AgentloopError(f"engine.launch.gpu_ids has {len(gpu_ids)} entries for {lc.num_servers} servers")
    servers = []
    for gid in gpu_ids:
        kw: dict[str, Any] = {"model_path": lc.model_path, "gpu_ids": [gid], "extra_args": tuple(lc.flags)}
        if lc.mem_fraction_static is not None:
            kw["mem_fraction_static"] = lc.mem_fraction_static
        servers.append(SGLangServer(SGLangLaunchConfig(**kw)))
    processes.extend(servers)
    return await start_servers(servers, timeout=ecfg.start_timeout)


async def load_tokenizer(ecfg: EngineConfig, model_path: str | None, clients: Sequence[EngineClient]) -> Any:
    """The tokenizer from `engine.tokenizer`, else `model_path`, else the first server that answers
    `model_info()` (a dead one among several is the lifecycle's to take out, not a reason to stop here)."""
    path = ecfg.tokenizer or model_path
    if path is None:
        errors = []
        for client in clients:
            try:
                with anyio.fail_after(ecfg.liveness_timeout):
                    info = await client.model_info()
            except (EngineError, TimeoutError, OSError) as e:
                why = (f"no answer to /model_info within {ecfg.liveness_timeout:g}s" if isinstance(e, TimeoutError)
                       else getattr(e, "message", None) or str(e) or type(e).__name__)
                errors.append(f"cannot reach the engine server at {client.url}: {why}")
                continue
            path = info.get("tokenizer_path") or info.get("model_path")
            if not path or not Path(path).exists():
                raise AgentloopError(
                    f"no tokenizer: the server at {client.url} reports tokenizer_path={path!r}, which is not a "
                    "local folder; set engine.tokenizer")
            break
        else:
            raise AgentloopError("no tokenizer (no engine server answers /model_info): " + "; ".join(errors))
    def load() -> Any:
        # Imported here, off the event loop: importing transformers takes seconds, and the loop must
        # keep serving the progress display and signals meanwhile.
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))

    return await anyio.to_thread.run_sync(load)


async def fit_context_to_engines(
    config: RuntimeConfig, clients: Sequence[EngineClient]
) -> tuple[RuntimeConfig, int | None]:
    """Lower `agent.max_context_tokens` to the smallest usable context the engines report (see
    `reported_context_length`), so an agent loop stops at the real limit instead of sending a
    request the engine refuses or cuts short. Only lowers; engines that report none (or cannot be
    asked) leave the configured value. Returns (config, that smallest context or None); the config
    is a copy when lowered, so the caller's object is left as given."""
    reported: dict[str, int] = {}
    for c in clients:
        try:
            with anyio.fail_after(30):
                n = reported_context_length(await c.server_info())
        except Exception as e:  # informational endpoint: the configured budget still holds
            log.warning("cannot read the context length of %s: %s", getattr(c, "url", c), e)
            continue
        if n is not None:
            reported[getattr(c, "url", repr(c))] = n
    context_length = min(reported.values()) if reported else None
    agent = config.agent
    if context_length is not None and context_length < agent.max_context_tokens:
        log.info("agent.max_context_tokens %d lowered to %d, the engines' usable context (%s)",
                 agent.max_context_tokens, context_length, reported)
        config = config.model_copy(update={"agent": agent.model_copy(update={"max_context_tokens": context_length})})
    return config, context_length


def reported_context_length(info: Mapping[str, Any]) -> int | None:
    """How long (prompt + response) a trajectory may grow on an engine, from its `/server_info`, so
    that every turn is accepted and gets the `max_new_tokens` it asks for. SGLang (and the CPU engine,
    which copies it) caps `max_new_tokens` at `context_length - 2 - input` (its scheduler's
    `max_req_len - input - 1`, `max_req_len = context - 1`) and aborts an input of
    `max_req_input_len` tokens or more; the CPU engine reports only `context_length`, SGLang reports
    `max_req_input_len` and `context_length` (null unless launched with `--context-length`)."""
    limits = []
    n = info.get("context_length")
    if isinstance(n, int) and not isinstance(n, bool) and n > 2:
        limits.append(n - 2)
    n = info.get("max_req_input_len")
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
        limits.append(n)
    return min(limits) if limits else None


async def start_all(procs: Sequence[Any], timeout: float) -> list[str]:
    """Start engine processes concurrently; the URLs in order. Any failure raises (and names the engine)."""
    urls: list[str | None] = [None] * len(procs)

    async def one(i: int) -> None:
        urls[i] = await procs[i].start(timeout=timeout)

    async with anyio.create_task_group() as tg:
        for i in range(len(procs)):
            tg.start_soon(one, i)
    return [u for u in urls if u is not None]
