"""Shared pieces of the CPU engine's HTTP layer: app keys, request limits, JSON bodies and SGLang's
error bodies.

Request limits (`RequestLimits`, `agentloop serve --max-request-bytes/--max-weights-request-bytes/
--max-n/--max-request-tokens`): a body is read only up to its endpoint's byte limit (a declared
Content-Length over it is refused before anything is read: 413), large only for
`/update_weights_from_tensor`; big bodies are decoded off the event loop so `/health` keeps answering;
a body nested too deeply for the JSON decoder is a 400 like any malformed body.

SGLang answers errors in two shapes and the CPU engine copies both (sglang 0.5.17 `http_server.py`):
- handler errors (a `ValueError` from validation or the engine): `{"error": {"message": ...}}`
  (`_create_error_response`), status 400 unless the error carries another;
- request-validation errors (FastAPI/pydantic: malformed JSON, a body field of the wrong type), and
  `HTTPException`s (e.g. removed endpoints): SGLang's `ErrorResponse`,
  `{"object": "error", "message", "type", "param": null, "code"}` where `type` is "Bad Request" for
  validation errors and the status as a string for HTTPExceptions.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from .admission import EngineInputError
from .engine import LocalEngine
from .limits import WEIGHT_PAYLOAD_PATHS, RequestLimits

ENGINE_KEY = web.AppKey("engine", LocalEngine)
ARGS_KEY = web.AppKey("server_args", dict)

LIMITS_KEY = web.AppKey("request_limits", RequestLimits)


class HeldBytes:
    """Body bytes held now over all requests (`RequestLimits.max_held_request_bytes`): each request
    reserves what it reads (all of it up front when `Content-Length` says) and gives it back when its
    handler ends (`release_held`, in the server's middleware)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0

    def reserve(self, request: web.Request, n: int) -> None:
        if self.held + n > self.limit:
            raise RequestValidationError(
                f"the server already holds {self.held} bytes of request bodies; {request.path} needs {n} more, over "
                f"the {self.limit} allowed at once (agentloop serve --max-held-request-bytes): retry later", status=429)
        self.held += n
        self.peak = max(self.peak, self.held)
        request[_HELD] = request.get(_HELD, 0) + n


HELD_KEY = web.AppKey("held_bytes", HeldBytes)
_HELD = "agentloop_held_bytes"


def release_held(request: web.Request) -> None:
    """Give back what the request reserved (called once its handler has ended)."""
    held = request.app.get(HELD_KEY)
    n = request.get(_HELD, 0)
    if held is not None and n:
        held.held -= n
        request[_HELD] = 0
#: Bodies larger than this are decoded in a worker thread (the event loop keeps serving meanwhile).
_DECODE_OFF_LOOP_BYTES = 1 << 20


class RequestValidationError(EngineInputError):
    """The body itself is malformed (what FastAPI's validation refuses before SGLang's handler runs)."""


def unhealthy_response(engine: LocalEngine) -> web.Response | None:
    """The 503 that `/health` and `/health_generate` answer while the engine cannot generate (its
    worker thread died, or weights / KV cache are released), else None."""
    if not engine.scheduler.alive:
        return web.Response(status=503, text="engine worker thread is not running")
    reason = engine.memory.generation_block_reason()
    if reason is not None:
        return web.Response(status=503, text=reason)
    return None


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def error_object(message: str, *, status: int = 400, type_: str = "Bad Request") -> dict[str, Any]:
    return {"object": "error", "message": message, "type": type_, "param": None, "code": status}


def http_exception(status: int, message: str) -> web.Response:
    """SGLang's body for an HTTPException (its exception handler): type is the status as a string."""
    return web.json_response(error_object(message, status=status, type_=str(status)), status=status)


def response_for(e: EngineInputError) -> web.Response:
    if isinstance(e, RequestValidationError):
        return web.json_response(error_object(e.message, status=e.status), status=e.status)
    return error_response(e.status, e.message)


async def read_body(request: web.Request) -> bytes:
    """The body, read only up to the endpoint's byte limit (413 past it, before reading when the
    Content-Length says so)."""
    limits = request.app.get(LIMITS_KEY) or RequestLimits()
    limit = limits.body_limit(request.path)
    too_large = (f"request body is larger than the {limit} bytes {request.path} accepts "
                 f"(agentloop serve --max-{'weights-' if request.path in WEIGHT_PAYLOAD_PATHS else ''}request-bytes)")
    if request.content_length is not None and request.content_length > limit:
        raise RequestValidationError(too_large, status=413)
    held = request.app.get(HELD_KEY)
    known = request.content_length or 0
    if held is not None and known:
        held.reserve(request, known)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise RequestValidationError(too_large, status=413)
        if held is not None and size > known:  # a chunked body: reserved as it comes
            held.reserve(request, len(chunk))
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestValidationError(f"malformed JSON body (JSON decode error): {e}") from None
    except RecursionError:
        raise RequestValidationError("malformed JSON body: nested too deeply") from None


async def json_body(request: web.Request, *, allow_empty: bool = False) -> dict[str, Any]:
    raw = await read_body(request)
    if not raw.strip():
        if allow_empty:
            return {}
        raise RequestValidationError("request body is empty; expected a JSON object")
    # A big body (weights) is decoded off the loop: /health and other requests keep being answered.
    body = await asyncio.to_thread(_decode, raw) if len(raw) > _DECODE_OFF_LOOP_BYTES else _decode(raw)
    if body is None and allow_empty:
        return {}
    if not isinstance(body, dict):
        raise RequestValidationError(f"the JSON body must be an object, got {type(body).__name__}")
    return body
