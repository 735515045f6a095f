"""The CPU engine's `/generate` (and `/health_generate`): SGLang's request normalisation, response
JSON and streaming, over `LocalEngine`.

Follows sglang 0.5.17 (`managers/io_struct.GenerateReqInput`, `tokenizer_manager`, `http_server`):
- batches: `input_ids` as a list of lists; a single string `rid` becomes `f"{rid}_{i}"`; per-item
  lists for `sampling_params`/`rid`/logprob fields; `sampling_params.n > 1` expands each input to n
  requests with rids `f"{rid}_{uuid}"` (a single input then answers with a list, like SGLang);
- `meta_info` has SGLang's keys in SGLang's order, incl. `output_token_logprobs_length`,
  `reasoning_tokens` (0: no reasoning parser), `cached_tokens_details` (None: nothing cached, the
  CPU engine has no prefix cache), `dp_rank` (None), `e2e_latency` on the final response, and
  `response_sent_to_client_ts` (wall clock) on the first response sent for a request: the final one
  when not streaming, the first chunk when streaming;
- errors: validation errors are 400 `{"error": {"message"}}`; with `stream: true` SGLang has already
  answered 200, so they (and failures mid-stream) arrive as `data: {"error": {message, type, code,
  retryable}}` followed by `data: [DONE]`.
Every generate holds a share of the engine's model-update lock for its whole life (`update_lock.ModelUpdateLock`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from .admission import EngineInputError
from .engine import LocalEngine
from .http_common import ENGINE_KEY, LIMITS_KEY, RequestLimits, RequestValidationError, error_response, http_exception, json_body, unhealthy_response
from .request import Request

_LOGPROB_FIELDS = (("return_logprob", False), ("logprob_start_len", -1), ("top_logprobs_num", 0))


# ---- request normalisation ------------------------------------------------------------------------
def _parallel_sample_num(sp: Any) -> int:
    def n_of(p: Any) -> Any:
        n = p.get("n", 1) if isinstance(p, dict) else 1
        return 1 if n is None else n

    if isinstance(sp, list):
        ns = {json.dumps(n_of(p)) for p in sp}
        if len(ns) > 1:
            raise EngineInputError("The parallel_sample_num should be the same for all samples in sample params.")
        n = n_of(sp[0]) if sp else 1
    else:
        n = n_of(sp)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise EngineInputError(f"sampling_params.n must be an integer >= 1, got {n!r}")
    return n


def _rids(rid: Any, batch_size: int, batch: bool) -> list[str | None]:
    """SGLang's `_normalize_rid` (one logical rid per input)."""
    if rid is None:
        return [None] * batch_size
    if not batch:
        return [rid]
    if isinstance(rid, str):
        return [rid] if batch_size == 1 else [f"{rid}_{i}" for i in range(batch_size)]
    if isinstance(rid, list):
        if len(rid) != batch_size:
            raise EngineInputError("The specified rids length mismatch with the batch_size for batch processing.")
        return rid
    raise EngineInputError("The rid should be a string or a list of strings.")


def build_requests(engine: LocalEngine, body: dict[str, Any],
                   limits: RequestLimits | None = None) -> tuple[list[Request], bool]:
    """The engine requests of one /generate body, in SGLang's output order; and whether it answers a list.
    `limits` bounds `n` and the total work (prompt + max_new_tokens over all samples), checked as the
    requests are built, so a huge ask is refused before it costs anything."""
    limits = limits or RequestLimits()
    ids = body.get("input_ids")
    if ids is None:
        if body.get("text") is not None:
            raise EngineInputError("text input needs a tokenizer; this engine runs like --skip-tokenizer-init: send input_ids")
        raise EngineInputError("Either text, input_ids or input_embeds should be provided.")
    if not isinstance(ids, list):  # pydantic refuses it before SGLang's handler runs
        raise RequestValidationError(f"input_ids: must be list or null; got {type(ids).__name__}")
    batch = len(ids) > 0 and isinstance(ids[0], list)
    items = ids if batch else [ids]
    sp = body.get("sampling_params")
    if isinstance(sp, list) and not batch:
        raise EngineInputError("sampling_params is a list but input_ids is a single sequence")
    if isinstance(sp, list) and len(sp) != len(items):
        raise EngineInputError(f"sampling_params is a list of {len(sp)} but the batch has {len(items)} inputs")
    n = _parallel_sample_num(sp)
    if n > limits.max_n:
        raise EngineInputError(f"sampling_params.n={n} is more than this server allows per request "
                               f"({limits.max_n}; agentloop serve --max-n)")
    rids = _rids(body.get("rid"), len(items), batch)
    per_item: dict[str, list[Any]] = {}
    for name, default in _LOGPROB_FIELDS:
        value = body.get(name)
        if isinstance(value, list):
            if not batch:
                raise EngineInputError(f"{name} is a list but input_ids is a single sequence")
            if n > 1:
                raise EngineInputError(f"Cannot use list {name} with parallel_sample_num > 1")
            if len(value) != len(items):
                raise EngineInputError(f"{name} is a list of {len(value)} but the batch has {len(items)} inputs")
            per_item[name] = value
        else:
            per_item[name] = [default if value is None else value] * len(items)
    reqs: list[Request] = []
    work = 0
    for i, item in enumerate(items):
        logical = rids[i]
        if logical is not None and not isinstance(logical, str):
            raise EngineInputError("The rid should be a string or a list of strings.")
        parent = None if n == 1 else (logical or uuid.uuid4().hex)
        for _ in range(n):
            rid = logical if parent is None else f"{parent}_{uuid.uuid4().hex}"
            reqs.append(engine.new_request(
                item,
                sp[i] if isinstance(sp, list) else sp,
                rid=rid,
                return_logprob=per_item["return_logprob"][i],
                logprob_start_len=per_item["logprob_start_len"][i],
                top_logprobs_num=per_item["top_logprobs_num"][i],
                priority=body.get("priority"),  # SGLang: one priority for every item of a batch
                where=f"input_ids[{i}]" if batch else "input_ids",
            ))
            reqs[-1].parent_rid = parent
            work += len(reqs[-1].input_ids) + reqs[-1].max_new_tokens
            if work > limits.max_request_tokens:
                raise EngineInputError(
                    f"the request asks for more than {limits.max_request_tokens} tokens of work (prompt + max_new_tokens "
                    f"over its {len(items) * n} samples; agentloop serve --max-request-tokens): send it in parts")
    got = [r.rid for r in reqs]
    if len(set(got)) != len(got):
        raise EngineInputError(f"rids in one batch must be unique, got {got}")
    return reqs, batch or n > 1


# ---- responses ------------------------------------------------------------------------------------
def _lp_items(values: list[Any], ids: list[int]) -> list[list[Any]]:
    return [[v, t, None] for v, t in zip(values, ids)]


def _top_items(tops: list[Any]) -> list[Any]:
    return [None if t is None else [[v, i, None] for v, i in t] for t in tops]


def response(req: Request, n: int, final: bool) -> dict[str, Any]:
    """SGLang's generate JSON for the first `n` output tokens of `req` (keys in SGLang's order)."""
    ids = req.output_ids[:n]
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason if final else None,
        "prompt_tokens": len(req.input_ids),
        "weight_version": req.weight_version,
        "num_retractions": req.num_retractions,
    }
    if req.return_logprob:
        meta["input_token_logprobs"] = (
            _lp_items(req.input_token_logprobs, req.input_ids[req.logprob_start_len:])
            if req.input_token_logprobs is not None else []
        )
        meta["output_token_logprobs"] = _lp_items(req.output_logprobs[:n], ids)
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = _top_items(req.input_top_logprobs or [])
            meta["output_top_logprobs"] = _top_items(req.output_top_logprobs[:n])
    meta.update({
        "reasoning_tokens": 0,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "cached_tokens_details": None,
        "dp_rank": None,
    })
    if final:
        meta["e2e_latency"] = req.e2e_latency()
    if not req.response_sent:
        req.response_sent = True
        meta["response_sent_to_client_ts"] = time.time()
    return {"output_ids": ids, "meta_info": meta}


def _failure(status: int, message: str) -> web.Response:
    # SGLang: a 400 abort becomes a ValueError ({"error": {"message"}}); 503/500 an HTTPException.
    return http_exception(status, message) if status >= 500 else error_response(status, message)


def stream_error(message: str, status: int = 400) -> bytes:
    """SGLang's SSE error chunk (http_server.generate_request's stream path)."""
    chunk = {"error": {"message": message, "type": "invalid_request_error", "code": status, "retryable": False}}
    return f"data: {json.dumps(chunk)}\n\n".encode()


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


# ---- handlers -------------------------------------------------------------------------------------
async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await json_body(request)
    stream = bool(body.get("stream", False))
    try:
        reqs, as_list = build_requests(engine, body, request.app.get(LIMITS_KEY))
    except RequestValidationError:
        raise
    except EngineInputError as e:
        if not stream:
            raise
        return await _stream_failure(request, e.message, e.status)
    for r in reqs:
        r.stream = stream
    loop = asyncio.get_running_loop()
    watches = [_Watch(loop) for _ in reqs]
    submitted: list[Request] = []
    async with engine.model_update_lock.reader():
        try:
            for r, w in zip(reqs, watches):
                submitted.append(r)  # before the await: a cancelled submit may still reach the worker
                await engine.submit(r, w.notifier)
            failed = next((r for r in reqs if r.error is not None), None)
            if failed is not None:
                for r in reqs:
                    if not r.finished:
                        await engine.abort(r.rid)
                if stream:
                    return await _stream_failure(request, failed.error[1], failed.error[0])
                return _failure(*failed.error)
            if stream:
                return await _stream(request, reqs, watches, as_list)
            for w in watches:
                while not w.finished:
                    await w.wait()
            failed = next((r for r in reqs if r.error is not None), None)
            if failed is not None:
                return _failure(*failed.error)
            out = [response(r, len(r.output_ids), True) for r in reqs]
            return web.json_response(out if as_list else out[0])
        finally:
            # A client that went away (handler cancelled) must not leave its requests decoding.
            for r in submitted:
                if not r.finished:
                    await asyncio.shield(engine.abort(r.rid))


async def _open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _stream_failure(request: web.Request, message: str, status: int) -> web.StreamResponse:
    """A refused streaming generate: SGLang has answered 200 already, so the error is a chunk."""
    resp = await _open_stream(request)
    await resp.write(stream_error(message, status))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _stream(request: web.Request, reqs: list[Request], watches: list[_Watch], as_list: bool) -> web.StreamResponse:
    resp = await _open_stream(request)
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
                await resp.write(stream_error(r.error[1], r.error[0]))
                pending.discard(i)
                continue
            final = w.finished
            if w.n == sent[i] and not final:
                continue
            chunk = response(r, len(r.output_ids) if final else w.n, final)
            if as_list:
                chunk["index"] = i
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            sent[i] = w.n
            if final:
                pending.discard(i)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def health_generate(request: web.Request) -> web.Response:
    """Like SGLang: a real one-token generate through the engine (503 while it cannot generate)."""
    engine = request.app[ENGINE_KEY]
    unhealthy = unhealthy_response(engine)
    if unhealthy is not None:
        return unhealthy
    req = engine.new_request([0], {"max_new_tokens": 1, "temperature": 0.0}, rid=f"HEALTH_CHECK_{time.monotonic_ns()}")
    w = _Watch(asyncio.get_running_loop())

    async def run() -> None:
        async with engine.model_update_lock.reader():
            await engine.submit(req, w.notifier)
            while not w.finished:
                await w.wait()

    try:
        await asyncio.wait_for(run(), timeout=20)
    except asyncio.TimeoutError:
        await engine.abort(req.rid)
        return web.Response(status=503, text="health generate timed out (engine paused or overloaded)")
    if req.error is not None:
        return web.Response(status=503, text=req.error[1])
    return web.Response(status=200)
