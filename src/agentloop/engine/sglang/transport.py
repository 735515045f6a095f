"""How the SGLang client talks HTTP to one server: the shared aiohttp session, a timeout on every
call, which failures are retried, and the keep-alive race.

Network discipline: one shared `aiohttp.ClientSession` (created lazily in the running event loop,
closed by `close()`), a timeout on every call, and retries with backoff only where repeating cannot
do harm: GET requests (they change nothing) and any request that provably never reached the server.
A POST that may have reached the server is never repeated: a repeated `/generate` would sample
twice, a repeated release would crash SGLang (torch_memory_saver refuses a double pause).

The keep-alive race: SGLang's uvicorn closes a connection idle for 5 s (`SGLANG_TIMEOUT_KEEP_ALIVE`),
aiohttp pools idle connections for 15 s by default, so a request written onto a connection the
server has just closed fails with `ServerDisconnectedError` (seen on the H200 after 0.5-3 s tool
waits). Two defences: the client drops pooled connections idle for `keepalive_timeout` seconds
(default 2 s, below the server's 5 s; `engine.keepalive_timeout`), and a request that provably never
reached the server is sent again, whatever the endpoint, lifecycle calls and generates included.
"Provably": the TCP connection could not be opened (`ClientConnectorError`), or a *reused*
connection was closed by the server before any byte of a response came back (`ServerDisconnectedError`
with no partial response, a reset/broken pipe, or the body could not be written). A live uvicorn never closes a connection that holds
an unanswered request (it answers errors with a status), so that close is its idle timeout racing our
write and the request was never read; a server that died while it held the request refuses the
repeat's connection, so nothing runs twice. A failure after the response started is never repeated.
Each server's reachability is logged once per change (unreachable, reachable again), not per request;
a server never reached yet is not warned about (a server still starting is polled; a wrong URL is the
caller's error, which carries the same reason).

Response bodies are capped (`max_response_bytes`, 256 MiB: a 32k-token generate with 20 top logprobs
per token is ~20 MB): a server that answers with an endless or enormous body gets an `EngineError`
naming the endpoint instead of growing this process until the trainer is killed for memory.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import json
import logging
import weakref
from typing import Any, Mapping, Sequence

import aiohttp
import anyio

from .. import wire_json
from ..base import EngineError, EngineUnavailable, engine_url
from .error_body import error_message

__all__ = ["DEFAULT_KEEPALIVE_SECONDS", "DEFAULT_MAX_RESPONSE_BYTES", "SGLANG_KEEPALIVE_SECONDS", "HttpTransport",
           "read_capped"]

log = logging.getLogger(__name__)

#: Connection failures that happen before any byte of the request left this process.
_NOT_SENT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,)
#: SGLang's HTTP keep-alive (uvicorn `timeout_keep_alive`, `SGLANG_TIMEOUT_KEEP_ALIVE`), seconds.
SGLANG_KEEPALIVE_SECONDS = 5.0
#: How long the client keeps an idle connection for reuse: well below the server's, so the server
#: never closes a connection the client is about to write on (aiohttp's own default is 15 s).
DEFAULT_KEEPALIVE_SECONDS = 2.0
#: Resends of one request after reused connections were found closed (each proven unsent).
_MAX_STALE_RESENDS = 3
#: The largest response body read from a server (see the module docstring).
DEFAULT_MAX_RESPONSE_BYTES = 256 << 20


class ResponseTooLarge(Exception):
    """A response body passed `max_response_bytes` (raised inside `_request`, reported as EngineError)."""


async def read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body of `resp`, or ResponseTooLarge once it passes `cap` bytes (declared or read)."""
    declared = resp.content_length
    if declared is not None and declared > cap:
        raise ResponseTooLarge(f"{declared} bytes declared")
    if declared is not None:  # uvicorn's JSON answers: one read, no per-chunk cost
        return await resp.read()
    buf = bytearray()
    async for chunk in resp.content.iter_any():
        buf += chunk
        if len(buf) > cap:
            raise ResponseTooLarge(f"more than {len(buf)} bytes so far")
    return bytes(buf)


def _closed_before_reply(e: BaseException, reused: bool) -> bool:
    """Whether `e` (raised before any response) proves the server never read the request: a reused
    connection the server had closed (clean close with nothing of a response parsed, a reset / broken
    pipe when our write met the closed socket, or aiohttp's "Can not write request body": the body
    never went out whole, so no server can have acted on it). See the module docstring."""
    if not reused:
        return False
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return isinstance(e.message, str)  # a partly received response would be its RawResponseMessage
    return isinstance(e, aiohttp.ClientOSError) and (
        e.errno in (errno.ECONNRESET, errno.EPIPE) or "Can not write request body" in str(e))


#: The mark of the request this task is sending (`{}`; `{"reused": True}` once it is on a pooled connection).
_SENDING: contextvars.ContextVar[dict[str, bool] | None] = contextvars.ContextVar("agentloop_sending", default=None)


class _ReuseAwareConnector(aiohttp.TCPConnector):
    """A `TCPConnector` that marks the request being sent when it leaves on a pooled connection: one whose
    protocol served a request before. aiohttp's own signal for that (`TraceConfig.on_connection_reuseconn`)
    makes every request create trace objects and await ~10 trace signals, ~35 us of client CPU per request
    against a local server; this is one set lookup per request."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._served: weakref.WeakSet[Any] = weakref.WeakSet()  # protocols of connections that were handed out

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        conn = await super().connect(req, traces, timeout)
        proto = conn.protocol
        if proto is not None:
            if proto in self._served:
                mark = _SENDING.get()
                if mark is not None:
                    mark["reused"] = True
            else:
                self._served.add(proto)
        return conn


#: asyncio.TimeoutError is not the builtin TimeoutError before Python 3.11.
_TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, asyncio.TimeoutError)
_JSON_HEADERS = {"Content-Type": "application/json"}


class HttpTransport:
    """Requests to one SGLang-compatible server (the base of `SGLangClient`): `_request` sends one
    with the rules above, `_json` / `_success_call` read its answer, `close()` ends the session.

    `timeout` bounds every call that gives none; `retries`/`backoff` apply only to safe-to-repeat
    requests; `keepalive_timeout`: seconds an idle pooled connection is reused (keep it below the
    server's, `SGLANG_KEEPALIVE_SECONDS`). A caller's own `session` keeps its connector's settings,
    and without our reuse-aware connector only connect failures are retried on it.
    `max_response_bytes` (an attribute; set it on an instance to change it) caps every response body.
    """

    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

    def __init__(
        self,
        url: str,
        *,
        timeout: float,
        session: aiohttp.ClientSession | None,
        retries: int,
        backoff: float,
        max_connections: int,
        keepalive_timeout: float,
    ) -> None:
        self.url = engine_url(url)
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_connections = max_connections
        if not 0 < keepalive_timeout < SGLANG_KEEPALIVE_SECONDS:
            log.warning("keepalive_timeout %.1fs for %s is not below SGLang's %.0fs: idle connections may be "
                        "closed under a request", keepalive_timeout, url, SGLANG_KEEPALIVE_SECONDS)
        self.keepalive_timeout = keepalive_timeout
        #: None until the first answer or failure; each change is logged once (`_reachable_now`).
        self.reachable: bool | None = None
        self._session = session
        self._owns_session = session is None

    # ------------------------------------------------------------------ session
    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            if not self._owns_session:
                raise EngineError("(session)", None, "the aiohttp session given to SGLangClient is closed", url=self.url)
            # limit: a rollout step keeps hundreds of generates open at once; aiohttp's default (100)
            # would queue them client-side and eat into their timeouts.
            self._session = aiohttp.ClientSession(connector=_ReuseAwareConnector(
                limit=self.max_connections, keepalive_timeout=self.keepalive_timeout))
        return self._session

    def _reachable_now(self, reachable: bool, why: str = "") -> None:
        """Log a change of this server's reachability once (not once per request).

        Only a server that answered before and stops is a warning here: one never reached yet (a
        server still starting, polled until it answers; a wrong URL) is its caller's to report, with
        the same error in its message, so it is not said twice (or at all, while a start is awaited)."""
        if reachable == self.reachable:
            return
        if not reachable:
            if self.reachable is None:
                log.debug("engine server %s not reachable (yet): %s", self.url, why)
                return  # still None: the first failure is not a change from a known state
            log.warning("engine server %s unreachable: %s", self.url, why)
        elif self.reachable is False:
            log.info("engine server %s reachable again", self.url)
        self.reachable = reachable

    async def close(self) -> None:
        if self._owns_session and self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None if self._owns_session else self._session

    # ------------------------------------------------------------------ transport
    async def _request(
        self,
        method: str,
        endpoint: str,
        body: Any = None,
        *,
        timeout: float | None = None,
        retry: bool | None = None,
        ok_statuses: Sequence[int] = (200,),
    ) -> tuple[int, bytes]:
        """Send one request; returns (status, body). Raises EngineUnavailable / EngineError.

        Statuses outside `ok_statuses` raise `EngineError` with the server's message.
        """
        if retry is None:
            retry = method == "GET"
        tmo = aiohttp.ClientTimeout(total=timeout if timeout is not None else self.timeout)
        failures = 0  # failed attempts that count against `retries`
        stale = 0  # resends after a reused connection was found closed (proven unsent; not counted)
        while True:
            if failures and not stale:
                await anyio.sleep(self.backoff * (2 ** (failures - 1)))
            conn: dict[str, bool] = {}  # set by our connector: {"reused": True} on a pooled connection
            sending = _SENDING.set(conn)
            replied = False
            try:
                kwargs: dict[str, Any] = {"timeout": tmo}
                if isinstance(body, bytes):  # already JSON (see wire_json)
                    kwargs["data"] = body
                    kwargs["headers"] = _JSON_HEADERS
                elif body is not None:
                    kwargs["json"] = body
                async with self._get_session().request(method, self.url + endpoint, **kwargs) as resp:
                    replied = True
                    try:
                        data = await read_capped(resp, self.max_response_bytes)
                    except ResponseTooLarge as big:
                        raise EngineError(endpoint, resp.status, f"response body too large ({big}; the limit is "
                                          f"{self.max_response_bytes} bytes): not read", url=self.url) from None
                    status = resp.status
            except (aiohttp.ClientError, *_TIMEOUT_ERRORS, OSError) as e:
                if not replied and stale < _MAX_STALE_RESENDS and _closed_before_reply(e, conn.get("reused", False)):
                    log.debug("%s %s: reused connection closed before the request was read (%s); sending again",
                              method, self.url + endpoint, e)
                    stale += 1
                    continue
                stale = 0
                failures += 1
                if isinstance(e, _NOT_SENT_ERRORS):
                    what, may_repeat = f"cannot connect: {e}", True  # nothing was sent
                elif isinstance(e, _TIMEOUT_ERRORS):
                    what, may_repeat = f"timed out after {tmo.total}s", retry
                else:
                    what, may_repeat = f"{type(e).__name__}: {e}", retry
                if may_repeat and failures <= self.retries:
                    continue
                self._reachable_now(False, what)
                raise EngineUnavailable(endpoint, None, what, url=self.url) from e
            finally:
                _SENDING.reset(sending)
            self._reachable_now(True)
            if status not in ok_statuses:
                if retry and status in (502, 503, 504) and failures < self.retries:
                    failures += 1
                    stale = 0
                    continue
                raise EngineError(endpoint, status, error_message(data), url=self.url)
            return status, data

    async def _json(self, method: str, endpoint: str, body: Any = None, **kw: Any) -> Any:
        _, data = await self._request(method, endpoint, body, **kw)
        if not data:
            return None
        try:
            return wire_json.loads(data)
        except ValueError as e:
            raise EngineError(endpoint, 200, f"response is not JSON: {data[:200]!r}", url=self.url) from e

    async def _success_call(self, endpoint: str, body: Mapping[str, Any], **kw: Any) -> dict[str, Any]:
        """POST to an endpoint answering `{"success", "message"}`; `success: false` raises."""
        status, data = await self._request("POST", endpoint, dict(body), ok_statuses=(200, 400), **kw)
        try:
            out = json.loads(data) if data else None
        except ValueError:
            out = None
        if not isinstance(out, dict) or "success" not in out:
            raise EngineError(endpoint, status, error_message(data), url=self.url)
        if not out["success"]:
            raise EngineError(endpoint, status, str(out.get("message", "")), url=self.url)
        return out
