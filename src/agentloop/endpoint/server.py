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
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator, Protocol

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


class Completer(Protocol):
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
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EndpointError(400, f"the request body is not valid JSON: {e}") from None
        req = parse_request(body)
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
        except web.HTTPException as e:  # unknown path or method: still an OpenAI-shaped error
            return _error_response(EndpointError(e.status, f"{request.method} {request.path}: {e.reason}",
                                                 type="invalid_request_error", code="not_found"))
        except Exception as e:  # a bug here must reach the agent as an error, not a dropped connection
            log.exception("endpoint: %s %s failed", request.method, request.path)
            return _error_response(EndpointError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))


def _error_response(e: EndpointError) -> web.Response:
    return web.json_response(error_body(e), status=e.status,
                             headers={"x-should-retry": "true" if e.retry else "false"})
