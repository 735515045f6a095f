"""The CPU reference engine's HTTP server (aiohttp.web), speaking SGLang's endpoints and JSON.

Endpoints, methods and payloads follow sglang 0.5.17's `entrypoints/http_server.py` and the real
responses in `tests/fixtures/sglang_http_samples.json` (`--skip-tokenizer-init`): token ids in and
out, no `text`. `/generate` lives in `generate_api.py`, error bodies in `http_common.py`; this module
has the control, memory, weight and info endpoints, the app and `run` (for `agentloop serve`).
Client errors get 4xx with SGLang's body (weight updates: `{"success": false, "message": ...}`) and
the server keeps serving. Generation while memory is released gets 503 with a message that says
which tags to resume.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import socket
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from aiohttp import web

from .admission import EngineInputError
from .engine import LocalEngine
from .generate_api import generate, health_generate
from .priority import PriorityPolicy
from .http_common import (
    ARGS_KEY, ENGINE_KEY, HELD_KEY, LIMITS_KEY, HeldBytes, RequestLimits, error_response, http_exception, json_body,
    release_held, response_for, unhealthy_response,
)

log = logging.getLogger("agentloop.serve")

FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
#: SGLang's body when a flush is refused without a message (requests running, no timeout).
FLUSH_FAILED_TEXT = "Flush cache failed.\n"


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Client errors → their status with a message; anything unexpected → 500, server lives on. The
    body bytes the request held are given back when it ends, however it ends."""
    try:
        return await handler(request)
    except EngineInputError as e:
        if request.path.startswith("/update_weights"):
            body: dict[str, Any] = {"success": False, "message": e.message}
            if request.path == "/update_weights_from_disk":
                body["num_paused_requests"] = 0  # SGLang's disk-update answers carry it, success or not
            return web.json_response(body, status=e.status)
        return response_for(e)
    except web.HTTPException:
        raise
    except Exception as e:  # noqa: BLE001 - reported to the client and logged, never swallowed
        log.exception("unhandled error on %s", request.path)
        return error_response(500, f"{type(e).__name__}: {e}")
    finally:
        release_held(request)


UPDATE_LOCK_KEY = web.AppKey("weight_update_lock", asyncio.Lock)


@asynccontextmanager
async def _one_weight_update(request: web.Request) -> AsyncIterator[None]:
    """One weight update at a time, its body included (two concurrent ~1 GiB bodies held 5.7 GB):
    a second waits up to `RequestLimits.weight_update_wait` seconds without reading its body, then
    is refused with 409. Afterwards the freed body memory goes back to the system (malloc_trim)."""
    lock = request.app[UPDATE_LOCK_KEY]
    wait = request.app[LIMITS_KEY].weight_update_wait
    try:
        await asyncio.wait_for(lock.acquire(), timeout=wait)
    except asyncio.TimeoutError:
        raise EngineInputError(f"another weight update is in progress; this one waited {wait:g} s for it "
                               "(one at a time: agentloop serve --weight-update-wait): send it again later",
                               status=409) from None
    try:
        yield
    finally:
        release_held(request)  # before the next update may start reading its body
        lock.release()
        await asyncio.to_thread(_trim)


def _trim() -> None:
    """Give freed heap pages back to the OS (glibc keeps them: ~2 GB stayed after large updates)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# ---- memory, weights, control ------------------------------------------------------------------
def _tags(body: dict[str, Any]) -> Any:
    tags = body.get("tags")
    if tags is not None and not isinstance(tags, list):
        raise EngineInputError(f"tags must be a list of strings, got {tags!r}")
    return tags


async def release_memory_occupation(request: web.Request) -> web.Response:
    body = await json_body(request, allow_empty=True)
    await request.app[ENGINE_KEY].release_memory(_tags(body))
    return web.json_response(None)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    body = await json_body(request, allow_empty=True)
    await request.app[ENGINE_KEY].resume_memory(_tags(body))
    return web.json_response(None)


def _update_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "load_format": body.get("load_format"),
        "weight_version": body.get("weight_version"),
        "abort_all_requests": bool(body.get("abort_all_requests", False)),
        "flush_cache": bool(body.get("flush_cache", True)),
    }


async def update_weights_from_disk(request: web.Request) -> web.Response:
    async with _one_weight_update(request):
        body = await json_body(request)
        msg = await request.app[ENGINE_KEY].update_weights_from_disk(body.get("model_path"), **_update_kwargs(body))
    return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    async with _one_weight_update(request):
        body = await json_body(request)
        if "serialized_named_tensors" not in body:
            raise EngineInputError("serialized_named_tensors is required")
        payloads = body.pop("serialized_named_tensors")
        kwargs = _update_kwargs(body)
        del body  # the payload strings are the bulk: nothing else keeps them alive while they are decoded
        msg = await request.app[ENGINE_KEY].update_weights_from_tensor(payloads, **kwargs)
    return web.json_response({"success": True, "message": msg})


async def update_weight_version(request: web.Request) -> web.Response:
    body = await json_body(request)
    if "new_version" not in body:
        raise EngineInputError("new_version is required")
    abort_all = body.get("abort_all_requests", True)  # SGLang's UpdateWeightVersionReqInput default
    if not isinstance(abort_all, bool):
        raise EngineInputError(f"abort_all_requests must be a boolean, got {abort_all!r}")
    version = body["new_version"]
    await request.app[ENGINE_KEY].update_weight_version(version, abort_all_requests=abort_all)
    return web.json_response({"success": True, "message": f"Weight version updated to {version}", "new_version": version})


async def flush_cache(request: web.Request) -> web.Response:
    raw = request.query.get("timeout", "0")
    try:
        timeout = float(raw)
    except ValueError:
        raise EngineInputError(f"timeout must be a number of seconds, got {raw!r}") from None
    if not 0 <= timeout < float("inf"):
        raise EngineInputError(f"timeout must be a finite number of seconds >= 0, got {raw!r}")
    ok, message = await request.app[ENGINE_KEY].flush_cache(timeout_s=timeout)
    if ok:
        return web.Response(text=FLUSH_TEXT, status=200)
    return web.Response(text=message or FLUSH_FAILED_TEXT, status=400)


async def pause_generation(request: web.Request) -> web.Response:
    body = await json_body(request, allow_empty=True)
    await request.app[ENGINE_KEY].pause(body.get("mode", "abort"))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await json_body(request, allow_empty=True)
    await request.app[ENGINE_KEY].continue_generation()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    body = await json_body(request)
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise EngineInputError(f"abort_all must be a boolean, got {abort_all!r}")
    if rid is not None and not isinstance(rid, str):
        raise EngineInputError(f"rid must be a string, got {rid!r}")
    if abort_all:
        await request.app[ENGINE_KEY].abort(None)
    elif rid:  # SGLang's AbortReq turns a missing rid into "", which matches nothing: 200, ignored
        await request.app[ENGINE_KEY].abort(rid)
    return web.Response(status=200)


# ---- health and info ---------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    unhealthy = unhealthy_response(request.app[ENGINE_KEY])
    return unhealthy if unhealthy is not None else web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    cfg = engine.runner.config
    return web.json_response({
        "model_path": engine.model_path,
        "tokenizer_path": engine.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(cfg, "model_type", None),
        "architectures": getattr(cfg, "architectures", None),
        "embedding": _embedding_plan(engine),
    })


def _embedding_plan(engine: LocalEngine) -> dict[str, Any]:
    """SGLang 0.5.17's resolved embedding plan for a generation (non-embedding) model, as it sends it."""
    budget = engine.scheduler.max_prefill_tokens
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, 8193, 512)]
    return {
        "family": "none", "task": "none", "execution": "none", "attention": "none", "pooling": "model_defined",
        "normalize": False, "postprocessor": "none", "tokenizer_special_tokens": "model_default",
        "supports_dimensions": False, "supports_token_embeddings": False, "supports_multimodal": False,
        "requires_embedding_flag": False, "auto_enable_embedding": False, "bcg_eligibility": "disabled",
        "safe_disable_kv_cache": False, "safe_disable_radix_cache": False, "safe_disable_chunked_prefill": False,
        "enabled": False, "matryoshka_dimensions": [],
        "bcg": {"prefill_backend": "disabled", "enabled": False, "capture_token_budget": budget,
                "capture_batch_sizes": [b for b in sizes if b <= budget]},
        "cache": {"kv_cache_disabled": False, "radix_cache_disabled": False, "chunked_prefill_disabled": False},
    }


async def weight_version(request: web.Request) -> web.Response:
    """Removed in SGLang: it answers 404 pointing to /model_info."""
    return http_exception(
        404, "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead."
    )


async def server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    stats = await engine.stats()
    import agentloop

    return web.json_response({
        **request.app[ARGS_KEY],
        "model_path": engine.model_path,
        "context_length": engine.context_length,
        "max_running_requests": engine.scheduler.max_running_requests,
        "max_prefill_tokens": engine.scheduler.max_prefill_tokens,
        "vocab_size": engine.vocab_size,  # read by SGLangClient.resolve_vocab_size (SGLang: the model config)
        "weight_version": engine.weight_version,
        "skip_tokenizer_init": True,
        "enable_memory_saver": True,
        "tp_size": 1,
        "dp_size": 1,
        "tensor_transport": "safetensors",
        "engine": "agentloop-cpu",
        "version": agentloop.__version__,
        # SGLang's free-form scheduler state; the CPU engine's logprob mode sits here, not in the args.
        # effective_max_running_requests_per_dp: SGLang's running-batch cap per DP rank, where
        # `scheduler.concurrency: auto` reads it (agentloop.runtime.concurrency).
        "internal_states": [{**stats, "return_original_logprob": engine.scheduler.original_logprob,
                             "effective_max_running_requests_per_dp": engine.scheduler.max_running_requests}],
    })


def build_app(engine: LocalEngine, server_args: dict[str, Any] | None = None,
              limits: RequestLimits | None = None) -> web.Application:
    limits = limits or RequestLimits()
    # Bodies are read by `read_body` under each endpoint's own limit; this is only the outer bound.
    app = web.Application(middlewares=[_errors],
                          client_max_size=max(limits.max_request_bytes, limits.max_weights_request_bytes))
    app[LIMITS_KEY] = limits
    app[HELD_KEY] = HeldBytes(limits.max_held_request_bytes)
    app[UPDATE_LOCK_KEY] = asyncio.Lock()
    app[ENGINE_KEY] = engine
    app[ARGS_KEY] = dict(server_args or {})
    # Methods as SGLang's decorators: @app.api_route(..., methods=[...]) / @app.get / @app.post.
    for method in ("POST", "PUT"):
        app.router.add_route(method, "/generate", generate)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/release_memory_occupation", release_memory_occupation)
        app.router.add_route(method, "/resume_memory_occupation", resume_memory_occupation)
        app.router.add_route(method, "/flush_cache", flush_cache)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    app.router.add_post("/update_weight_version", update_weight_version)
    app.router.add_get("/get_weight_version", weight_version)
    app.router.add_get("/weight_version", weight_version)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)

    async def _shutdown(app: web.Application) -> None:
        # Finish every open request (handlers return their partial output), then stop the thread.
        try:
            await asyncio.wait_for(engine.abort(None), timeout=5)
        finally:
            engine.stop()

    app.on_shutdown.append(_shutdown)
    return app


# ---- `agentloop serve` (arguments in src/agentloop/commands/serve.py, kept light for the CLI) ----------
def _default_model() -> str | None:
    try:
        from agentloop.models import tiny_tool_model  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        return str(tiny_tool_model())
    except Exception:  # noqa: BLE001 - a missing shipped model just means --model is required
        return None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    model = args.model or _default_model()
    if model is None:
        print("agentloop serve: --model DIR is required (the shipped tiny model is not available)", file=sys.stderr)
        return 2
    if not Path(model).is_dir():
        print(f"agentloop serve: --model {model}: not a folder", file=sys.stderr)
        return 2
    # Bind before loading the model: a busy port is reported at once, and `--port 0` works (the log
    # line names the port the OS chose).
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        hint = (" (another server holds that port: give --port N, or --port 0 for a free one)"
                if e.errno == errno.EADDRINUSE else "")
        print(f"agentloop serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}{hint}", file=sys.stderr)
        return 1
    priority = PriorityPolicy(enabled=args.enable_priority_scheduling,
                              low_values_first=args.schedule_low_priority_values_first,
                              preemption=not args.disable_priority_preemption,
                              preemption_threshold=args.priority_scheduling_preemption_threshold,
                              abort_when_disabled=args.abort_on_priority_when_disabled)
    engine = LocalEngine(
        model,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        weight_version=args.weight_version,
        seed=args.seed,
        original_logprob=args.return_original_logprob,
        num_threads=args.num_threads,
        max_prefill_tokens=args.max_prefill_tokens,
        priority=priority,
    )
    engine.start()
    # the priority flags under SGLang's server-arg names: /server_info reports them as SGLang does
    server_args = {"host": args.host, "port": args.port, "random_seed": args.seed,
                   "enable_priority_scheduling": priority.enabled,
                   "schedule_low_priority_values_first": priority.low_values_first,
                   "disable_priority_preemption": not priority.preemption,
                   "priority_scheduling_preemption_threshold": priority.preemption_threshold,
                   "abort_on_priority_when_disabled": priority.abort_when_disabled}
    port = sock.getsockname()[1]
    server_args["port"] = port
    log.info("agentloop CPU engine: model %s, serving on http://%s:%d", model, args.host, port)
    limits = RequestLimits(max_request_bytes=args.max_request_bytes, max_weights_request_bytes=args.max_weights_request_bytes,
                           max_n=args.max_n, max_request_tokens=args.max_request_tokens,
                           max_held_request_bytes=args.max_held_request_bytes,
                           weight_update_wait=args.weight_update_wait)
    web.run_app(build_app(engine, server_args, limits), sock=sock, print=None, access_log=None,
                # Cancel a handler whose client went away, so its requests are aborted (SGLang does too).
                handler_cancellation=True)
    return 0
