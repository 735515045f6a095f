"""Shared pieces of the CPU engine's HTTP layer: app keys, JSON bodies and SGLang's error bodies.

SGLang answers errors in two shapes and the CPU engine copies both (sglang 0.5.17 `http_server.py`):
- handler errors (a `ValueError` from validation or the engine): `{"error": {"message": ...}}`
  (`_create_error_response`), status 400 unless the error carries another;
- request-validation errors (FastAPI/pydantic: malformed JSON, a body field of the wrong type), and
  `HTTPException`s (e.g. removed endpoints): SGLang's `ErrorResponse`,
  `{"object": "error", "message", "type", "param": null, "code"}` where `type` is "Bad Request" for
  validation errors and the status as a string for HTTPExceptions.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from .engine import EngineInputError, LocalEngine

ENGINE_KEY = web.AppKey("engine", LocalEngine)
ARGS_KEY = web.AppKey("server_args", dict)


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


async def json_body(request: web.Request, *, allow_empty: bool = False) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise RequestValidationError("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestValidationError(f"malformed JSON body (JSON decode error): {e}") from None
    if body is None and allow_empty:
        return {}
    if not isinstance(body, dict):
        raise RequestValidationError(f"the JSON body must be an object, got {type(body).__name__}")
    return body
