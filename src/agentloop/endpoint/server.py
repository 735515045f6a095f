"""The loopback HTTP server of the OpenAI-compatible endpoint (aiohttp), one per `openai` agent loop.

Routes, each scoped to one running trajectory by a random key:

- `POST /t/{key}/v1/chat/completions`, `GET /t/{key}/v1/models` — the key in the path (the base URL a
  trajectory's client is given: `{url}/t/{key}/v1`);
- `POST /v1/chat/completions`, `GET /v1/models` — the key as the API key (`Authorization: Bearer {key}`).

`EndpointServer.open(completer)` registers a trajectory and yields its `Route` (base URL and key);
leaving the block unregisters it and cancels its calls still running, so a client that outlives its
trajectory gets a 404 and never reaches the engine. The server only moves requests: answering one is
the `Completer`'s job (`TrajectoryRecorder`). Errors are OpenAI-shaped JSON with `x-should-retry:
false`; a streamed answer is sent as server-sent events (`stream: true`).

Hostile sizes never reach the event loop's hot path: a body over the completer's `max_request_bytes`
(the trajectory's context budget in bytes, `input_budget`) is a 400 `context_length_exceeded` decided
from `Content-Length` or while reading, before any parsing; a body over `MAX_BODY_BYTES` is a 413;
a large body is parsed and validated in a worker thread; JSON nested too deeply is a 400.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator, Protocol

import anyio
from aiohttp import web

from .protocol import (
    ChatCompletionRequest,
    CompletionResult,
    EndpointError,
    chunk_bodies,
    completion_body,
    error_body,
    models_body,
    parse_request,
)

log = logging.getLogger(__name__)

__all__ = ["Completer", "EndpointServer", "Route"]

#: Conversations with long tool results can be large; aiohttp's default body limit is 1 MiB.
MAX_BODY_BYTES = 64 * 2**20
#: Bodies larger than this are parsed off the event loop (parsing 1 MiB of JSON takes ~10 ms).
OFF_LOOP_BYTES = 256 * 2**10


class Completer(Protocol):
    """Answers a trajectory's calls. May also have `max_request_bytes` (int or None): larger bodies are
    refused as not fitting the context, before they are parsed."""

    async def complete(self, request: ChatCompletionRequest) -> CompletionResult: ...


@dataclass(frozen=True)
class Route:
    """Where one trajectory's client talks to the endpoint."""

    base_url: str  #: `{server}/t/{key}/v1`: give it to `openai.AsyncOpenAI(base_url=...)`
    key: str  #: also accepted as the API key on `{server}/v1`


@dataclass
class _Entry:
    completer: Completer
    scopes: set[anyio.CancelScope] = field(default_factory=set)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class EndpointServer:
    """Serves `/v1/chat/completions` and `/v1/models` for the trajectories registered with `open`."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, model_name: str = "agentloop") -> None:
        self.host = host
        self.port = port
        self.model_name = model_name
        self.created = int(time.time())
        self._entries: dict[str, _Entry] = {}
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        if self._runner is None:
            raise RuntimeError("EndpointServer is not started")
        return f"http://{self.host}:{self.port}"

    @property
    def open_trajectories(self) -> int:
        return len(self._entries)

    async def start(self) -> "EndpointServer":
        if self._runner is not None:
            return self
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_post("/t/{key}/v1/chat/completions", self._chat)
        app.router.add_get("/t/{key}/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self.port = runner.addresses[0][1]
        self._runner = runner
        return self

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    @contextlib.contextmanager
    def open(self, completer: Completer) -> Iterator[Route]:
        """Register one trajectory for the duration of the block."""
        key = "traj-" + secrets.token_urlsafe(18)
        entry = _Entry(completer)
        self._entries[key] = entry
        try:
            yield Route(base_url=f"{self.url}/t/{key}/v1", key=key)
        finally:
            del self._entries[key]
            for scope in list(entry.scopes):
                scope.cancel()

    # ------------------------------------------------------------------ handlers
    def _entry(self, request: web.Request) -> _Entry:
        key = request.match_info.get("key")
        if key is None:
            auth = request.headers.get("Authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if not key:
                raise EndpointError(401, "no trajectory key: use the base URL the trajectory's client was given "
                                    "({server}/t/{key}/v1) or send the key as the API key", type="authentication_error",
                                    code="invalid_api_key")
        entry = self._entries.get(key)
        if entry is None:
            raise EndpointError(404, "no running trajectory has this key (it ended, or never existed); nothing was "
                                "generated", type="not_found_error", code="trajectory_not_found")
        return entry

    async def _models(self, request: web.Request) -> web.StreamResponse:
        self._entry(request)
        return web.json_response(models_body(self.model_name, self.created))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        entry = self._entry(request)
        raw = await _read_body(request, getattr(entry.completer, "max_request_bytes", None))
        if len(raw) > OFF_LOOP_BYTES:
            req = await anyio.to_thread.run_sync(_parse, raw)
        else:
            req = _parse(raw)
        scope = anyio.CancelScope()
        entry.scopes.add(scope)
        try:
            with scope:
                result = await entry.completer.complete(req)
        finally:
            entry.scopes.discard(scope)
        if scope.cancelled_caught:
            raise EndpointError(503, "the trajectory ended while this call was running", type="server_error",
                                code="trajectory_ended")
        if not req.stream:
            return web.json_response(completion_body(result, self.model_name))
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in chunk_bodies(result, self.model_name, include_usage=include_usage):
            await resp.write(b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except EndpointError as e:
            return _error_response(e)
        except web.HTTPException as e:  # unknown path or method, a body too large: still an OpenAI-shaped error
            code = _HTTP_CODES.get(e.status, "http_error")
            return _error_response(EndpointError(e.status, f"{request.method} {request.path}: {e.reason}",
                                                 type="invalid_request_error", code=code))
        except RecursionError:  # nesting deep enough to exhaust the stack anywhere past the parser
            return _error_response(EndpointError(400, "the request is nested too deeply", code="nested_too_deeply"))
        except Exception as e:  # a bug here must reach the agent as an error, not a dropped connection
            log.exception("endpoint: %s %s failed", request.method, request.path)
            return _error_response(EndpointError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _too_long(size: int | str, limit: int) -> EndpointError:
    return EndpointError(400, f"the request body ({size} bytes) cannot fit this trajectory's context: bodies over "
                         f"{limit} bytes are refused before parsing (agent.max_context_tokens)",
                         code="context_length_exceeded", param="messages")


async def _read_body(request: web.Request, limit: int | None) -> bytes:
    """The body, refused (400) as soon as it is known to be over `limit`: from `Content-Length`
    before reading, else while reading it (a chunked body), never holding more than `limit` + a chunk."""
    if limit is None or limit >= MAX_BODY_BYTES:
        return await request.read()  # aiohttp answers 413 past MAX_BODY_BYTES
    if request.content_length is not None and request.content_length > limit:
        raise _too_long(request.content_length, limit)
    parts: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise _too_long(f"over {size}", limit)
        parts.append(chunk)
    return b"".join(parts)


def _parse(raw: bytes) -> ChatCompletionRequest:
    """JSON and then the request's fields; every problem an `EndpointError` (400)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EndpointError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise EndpointError(400, "the request body is nested too deeply", code="nested_too_deeply") from None
    try:
        return parse_request(body)
    except RecursionError:
        raise EndpointError(400, "the request body is nested too deeply", code="nested_too_deeply") from None


def _error_response(e: EndpointError) -> web.Response:
    return web.json_response(error_body(e), status=e.status,
                             headers={"x-should-retry": "true" if e.retry else "false"})
