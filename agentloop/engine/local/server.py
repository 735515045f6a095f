"""The CPU reference engine's HTTP server (aiohttp.web), speaking SGLang's endpoints and JSON.

Endpoints and payloads follow `shared/sglang-api.md` and the real responses in
`shared/gpu/samples/http_samples.json` (sglang 0.5.17 with `--skip-tokenizer-init`): token ids in
and out, no `text`. Client errors get 4xx with `{"error": {"message": ...}}` (weight updates:
`{"success": false, "message": ...}`), and the server keeps serving. Generation while memory is
released gets 503 with a message that says which tags to resume. Also the `agentloop serve`
subcommand (`add_parser` / `run`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from .engine import EngineInputError, LocalEngine
from .request import Request

log = logging.getLogger("agentloop.serve")

FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
ENGINE_KEY = web.AppKey("engine", LocalEngine)
ARGS_KEY = web.AppKey("server_args", dict)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _json_body(request: web.Request, *, allow_empty: bool = False) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise EngineInputError("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineInputError(f"malformed JSON body: {e}") from None
    if body is None and allow_empty:
        return {}
    if not isinstance(body, dict):
        raise EngineInputError(f"the JSON body must be an object, got {type(body).__name__}")
    return body


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Client errors → their status with a message; anything unexpected → 500, server lives on."""
    try:
        return await handler(request)
    except EngineInputError as e:
        if request.path.startswith("/update_weights"):
            body: dict[str, Any] = {"success": False, "message": e.message}
            if request.path == "/update_weights_from_disk":
                body["num_paused_requests"] = 0  # SGLang's disk-update answers carry it, success or not
            return web.json_response(body, status=e.status)
        return _error(e.status, e.message)
    except web.HTTPException:
        raise
    except Exception as e:  # noqa: BLE001 - reported to the client and logged, never swallowed
        log.exception("unhandled error on %s", request.path)
        return _error(500, f"{type(e).__name__}: {e}")


# ---- /generate ---------------------------------------------------------------------------------
def _per_item(value: Any, i: int, n: int, name: str) -> Any:
    if isinstance(value, list) and name != "input_ids":
        if len(value) != n:
            raise EngineInputError(f"{name} is a list of {len(value)} but the batch has {n} inputs")
        return value[i]
    return value


def _build_requests(engine: LocalEngine, body: dict[str, Any]) -> tuple[list[Request], bool]:
    if "input_ids" not in body or body["input_ids"] is None:
        if body.get("text") is not None:
            raise EngineInputError("text input needs a tokenizer; this engine runs like --skip-tokenizer-init: send input_ids")
        raise EngineInputError("input_ids is required")
    ids = body["input_ids"]
    batch = isinstance(ids, list) and len(ids) > 0 and isinstance(ids[0], list)
    items = ids if batch else [ids]
    n = len(items)
    sp = body.get("sampling_params")
    if isinstance(sp, list) and not batch:
        raise EngineInputError("sampling_params is a list but input_ids is a single sequence")
    reqs = []
    for i, item in enumerate(items):
        reqs.append(
            engine.new_request(
                item,
                _per_item(sp, i, n, "sampling_params") if batch else sp,
                rid=_per_item(body.get("rid"), i, n, "rid") if batch else body.get("rid"),
                return_logprob=_per_item(body.get("return_logprob", False), i, n, "return_logprob") or False,
                logprob_start_len=_per_item(body.get("logprob_start_len", -1), i, n, "logprob_start_len"),
                top_logprobs_num=_per_item(body.get("top_logprobs_num", 0), i, n, "top_logprobs_num") or 0,
                where=f"input_ids[{i}]" if batch else "input_ids",
            )
        )
    rids = [r.rid for r in reqs]
    if len(set(rids)) != len(rids):
        raise EngineInputError(f"rids in one batch must be unique, got {rids}")
    return reqs, batch


def _lp_items(values: list[Any], ids: list[int]) -> list[list[Any]]:
    return [[v, t, None] for v, t in zip(values, ids)]


def _top_items(tops: list[Any]) -> list[Any]:
    return [None if t is None else [[v, i, None] for v, i in t] for t in tops]


def _response(req: Request, n: int, final: bool) -> dict[str, Any]:
    """SGLang's generate JSON for the first `n` output tokens of `req`."""
    ids = req.output_ids[:n]
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason if final else None,
        "prompt_tokens": len(req.input_ids),
        "weight_version": req.weight_version,
        "num_retractions": req.num_retractions,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
    }
    if req.return_logprob:
        meta["input_token_logprobs"] = (
            _lp_items(req.input_token_logprobs, req.input_ids[req.logprob_start_len:])
            if req.input_token_logprobs is not None else []
        )
        meta["output_token_logprobs"] = _lp_items(req.output_logprobs[:n], ids)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = _top_items(req.input_top_logprobs or [])
            meta["output_top_logprobs"] = _top_items(req.output_top_logprobs[:n])
    if final:
        meta["e2e_latency"] = req.e2e_latency()
    return {"output_ids": ids, "meta_info": meta}


class _Watch:
    """Receives (n, finished) from the worker thread on the event loop; keeps only the newest."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.n = 0
        self.finished = False
        self.changed = asyncio.Event()

    def notifier(self, n: int, finished: bool) -> None:
        self.loop.call_soon_threadsafe(self._set, n, finished)

    def _set(self, n: int, finished: bool) -> None:
        self.n = max(self.n, n)
        self.finished = self.finished or finished
        self.changed.set()

    async def wait(self) -> None:
        await self.changed.wait()
        self.changed.clear()


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await _json_body(request)
    reqs, batch = _build_requests(engine, body)
    stream = bool(body.get("stream", False))
    for r in reqs:
        r.stream = stream
    loop = asyncio.get_running_loop()
    watches = [_Watch(loop) for _ in reqs]
    submitted: list[Request] = []
    try:
        for r, w in zip(reqs, watches):
            submitted.append(r)  # before the await: a cancelled submit may still reach the worker
            await engine.submit(r, w.notifier)
        failed = next((r for r in reqs if r.error is not None), None)
        if failed is not None:
            for r in reqs:
                if not r.finished:
                    await engine.abort(r.rid)
            return _error(failed.error[0], failed.error[1])
        if stream:
            return await _stream(request, reqs, watches, batch)
        for w in watches:
            while not w.finished:
                await w.wait()
        failed = next((r for r in reqs if r.error is not None), None)
        if failed is not None:
            return _error(failed.error[0], failed.error[1])
        out = [_response(r, len(r.output_ids), True) for r in reqs]
        return web.json_response(out if batch else out[0])
    finally:
        # A client that went away (handler cancelled) must not leave its requests decoding.
        for r in submitted:
            if not r.finished:
                await asyncio.shield(engine.abort(r.rid))


async def _stream(request: web.Request, reqs: list[Request], watches: list[_Watch], batch: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    sent = [-1] * len(reqs)
    pending = set(range(len(reqs)))
    while pending:
        waits = {asyncio.ensure_future(watches[i].wait()): i for i in pending}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waits:
                t.cancel()
        for i in sorted(pending):
            r, w = reqs[i], watches[i]
            if r.error is not None:
                chunk: dict[str, Any] = {"error": {"message": r.error[1]}}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                pending.discard(i)
                continue
            final = w.finished
            if w.n == sent[i] and not final:
                continue
            chunk = _response(r, len(r.output_ids) if final else w.n, final)
            if batch:
                chunk["index"] = i
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            sent[i] = w.n
            if final:
                pending.discard(i)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


# ---- memory, weights, control ------------------------------------------------------------------
def _tags(body: dict[str, Any]) -> Any:
    tags = body.get("tags")
    if tags is not None and not isinstance(tags, list):
        raise EngineInputError(f"tags must be a list of strings, got {tags!r}")
    return tags


async def release_memory_occupation(request: web.Request) -> web.Response:
    body = await _json_body(request, allow_empty=True)
    await request.app[ENGINE_KEY].release_memory(_tags(body))
    return web.json_response(None)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    body = await _json_body(request, allow_empty=True)
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
    body = await _json_body(request)
    msg = await request.app[ENGINE_KEY].update_weights_from_disk(body.get("model_path"), **_update_kwargs(body))
    return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    body = await _json_body(request)
    if "serialized_named_tensors" not in body:
        raise EngineInputError("serialized_named_tensors is required")
    msg = await request.app[ENGINE_KEY].update_weights_from_tensor(body["serialized_named_tensors"], **_update_kwargs(body))
    return web.json_response({"success": True, "message": msg})


async def flush_cache(request: web.Request) -> web.Response:
    ok = await request.app[ENGINE_KEY].flush_cache()
    return web.Response(text=FLUSH_TEXT, status=200 if ok else 400)


async def pause_generation(request: web.Request) -> web.Response:
    body = await _json_body(request, allow_empty=True)
    await request.app[ENGINE_KEY].pause(body.get("mode", "abort"))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await _json_body(request, allow_empty=True)
    await request.app[ENGINE_KEY].continue_generation()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    body = await _json_body(request)
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise EngineInputError(f"abort_all must be a boolean, got {abort_all!r}")
    if not abort_all and not isinstance(rid, str):
        raise EngineInputError('abort_request needs {"rid": "<id>"} or {"abort_all": true}')
    await request.app[ENGINE_KEY].abort(None if abort_all else rid)
    return web.Response(status=200)


# ---- health and info ---------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.scheduler.alive:
        return web.Response(status=503, text="engine worker thread is not running")
    reason = engine.memory.generation_block_reason()
    if reason is not None:
        return web.Response(status=503, text=reason)
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    """Like SGLang: a real one-token generate through the engine."""
    engine = request.app[ENGINE_KEY]
    resp = await health(request)
    if resp.status != 200:
        return resp
    req = engine.new_request([0], {"max_new_tokens": 1, "temperature": 0.0}, rid=f"HEALTH_CHECK_{time.monotonic_ns()}")
    w = _Watch(asyncio.get_running_loop())
    await engine.submit(req, w.notifier)
    try:
        while not w.finished:
            await asyncio.wait_for(w.wait(), timeout=20)
    except asyncio.TimeoutError:
        await engine.abort(req.rid)
        return web.Response(status=503, text="health generate timed out (engine paused or overloaded)")
    if req.error is not None:
        return web.Response(status=503, text=req.error[1])
    return web.Response(status=200)


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
    })


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
        "vocab_size": engine.vocab_size,
        "eos_token_ids": engine.runner.eos_token_ids,
        "weight_version": engine.weight_version,
        "skip_tokenizer_init": True,
        "enable_memory_saver": True,
        "tp_size": 1,
        "dp_size": 1,
        "tensor_transport": "safetensors",
        "engine": "agentloop-cpu",
        "version": agentloop.__version__,
        "internal_states": [stats],
    })


def build_app(engine: LocalEngine, server_args: dict[str, Any] | None = None) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=1024**3)
    app[ENGINE_KEY] = engine
    app[ARGS_KEY] = dict(server_args or {})
    app.router.add_post("/generate", generate)
    app.router.add_post("/release_memory_occupation", release_memory_occupation)
    app.router.add_post("/resume_memory_occupation", resume_memory_occupation)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_route("POST", "/flush_cache", flush_cache)
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


# ---- `agentloop serve` (arguments in agentloop/commands/serve.py, kept light for the CLI) ----------
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
    engine = LocalEngine(
        model,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        weight_version=args.weight_version,
        seed=args.seed,
        original_logprob=args.return_original_logprob,
        num_threads=args.num_threads,
        max_prefill_tokens=args.max_prefill_tokens,
    )
    engine.start()
    server_args = {
        "host": args.host, "port": args.port, "random_seed": args.seed,
        "return_original_logprob": args.return_original_logprob,
    }
    log.info("agentloop CPU engine: model %s, serving on http://%s:%d", model, args.host, args.port)
    web.run_app(build_app(engine, server_args), host=args.host, port=args.port, print=None, access_log=None,
                # Cancel a handler whose client went away, so its requests are aborted (SGLang does too).
                handler_cancellation=True)
    return 0
