"""The `openai` agent loop: runs an agent written against the OpenAI chat API, with exact tokens.

Per trajectory it calls the user's function

    async def agent(client: openai.AsyncOpenAI, sample: agentloop.types.Sample) -> Any

with a client bound to that trajectory's endpoint (this package's loopback server, owned by this loop, started on first use and closed with the runtime). Every chat completion the agent makes
is generated through the trajectory's `AgentContext.generate` — the scheduler's sticky route and the
lifecycle gate — and recorded token for token (`TrajectoryRecorder`). The function is named by
`agent.function` (`"package.module:function"`, in YAML: `agent: {agent: openai, function: ...}`) or
per sample by `sample.extra["function"]`.

What the function returns: a number, a `RewardResult` or a dict with "reward" is the trajectory's
reward; anything else (e.g. the final answer) is kept in `extra["agent_output"]` and the usual reward
functions score the trajectory. An exception the function raises fails the trajectory (its calls so far
are kept), unless a call was refused first: a stopped trajectory (sleep, early stop, timeout) is
`aborted` and carried over — an agent function cannot be resumed mid-way, so the carried sample starts
again from its prompt — and a refused budget or turn limit is `truncated`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import anyio

from ..agents.base import AgentConfig, AgentContext, AgentLoop
from ..agents.episode import Episode
from ..agents.registry import register_agent
from ..agents.resolve import import_path
from ..types import Sample, Trajectory
from .recorder import TrajectoryRecorder
from .server import EndpointServer

__all__ = ["OpenAIAgent", "agent_function"]

#: Seconds one call of the client may take; the scheduler's trajectory timeout bounds the whole run.
CLIENT_TIMEOUT = 600.0


def agent_function(sample: Sample, config: AgentConfig) -> Callable[..., Any]:
    """The user's agent function for `sample`: `sample.extra["function"]`, else `agent.function`.
    Raises ValueError/ImportError/TypeError saying what is wrong."""
    spec = sample.extra.get("function") or config.function
    if spec is None:
        raise ValueError("the openai agent loop needs the agent function: set agent.function to "
                         "'package.module:function' (or a sample's extra['function'])")
    fn = spec if callable(spec) else import_path(str(spec), f"agent.function {spec!r}")
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        raise TypeError(f"agent.function {spec!r} must be an async function (client, sample) -> result")
    return fn


def _openai() -> Any:
    try:
        import openai
    except ImportError:
        raise ImportError("the openai agent loop needs the official client: pip install 'agentloop[openai]'") from None
    return openai


def _shared_client(openai: Any, url: str) -> tuple[Any, Any]:
    """One `AsyncOpenAI` whose connection pool every trajectory's client shares (`with_options` copies
    share it): building a client per trajectory costs ~0.15 s of CPU (an SSL context is loaded even for
    plain HTTP). A trajectory's agent closing its client leaves the pool open; the loop closes it."""

    class SharedPool(openai.DefaultAsyncHttpxClient):  # type: ignore[misc, name-defined]
        async def aclose(self) -> None:
            pass

        async def close_pool(self) -> None:
            await super().aclose()

    # No retries: every error the endpoint sends is final for that request (a retried timeout would
    # only come back as a rewritten history).
    pool = SharedPool(timeout=CLIENT_TIMEOUT)
    client = openai.AsyncOpenAI(base_url=url, api_key="per-trajectory", max_retries=0, timeout=CLIENT_TIMEOUT,
                                http_client=pool)
    return client, pool


@register_agent
class OpenAIAgent(AgentLoop):
    name = "openai"

    def __init__(self) -> None:
        self._server: EndpointServer | None = None
        self._client: Any = None  #: the shared `AsyncOpenAI` (trajectories get `with_options` copies)
        self._pool: Any = None  #: its connection pool
        self._starting: anyio.Lock | None = None

    async def server(self) -> EndpointServer:
        """The loop's endpoint server (started on first use; trajectories share it)."""
        if self._starting is None:
            self._starting = anyio.Lock()
        async with self._starting:
            if self._server is None:
                self._server = await EndpointServer().start()
        return self._server

    async def aclose(self) -> None:
        if self._pool is not None:
            pool, self._pool, self._client = self._pool, None, None
            await pool.close_pool()
        if self._server is not None:
            server, self._server = self._server, None
            await server.close()

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        try:
            fn = agent_function(sample, ctx.config)
            openai = _openai()
        except Exception as e:  # a bad path or a missing package: this sample fails, the step goes on
            return Episode.failed_before_start(sample, ctx, e)
        name = getattr(fn, "__qualname__", repr(fn))
        recorder = TrajectoryRecorder(sample, ctx)
        server = await self.server()
        if self._client is None:
            self._client, self._pool = _shared_client(openai, server.url)
        value: Any = None
        error: BaseException | None = None
        with server.open(recorder) as route:
            client = self._client.with_options(base_url=route.base_url, api_key=route.key)
            try:
                value = await fn(client, sample)
            except Exception as e:
                error = e
        return recorder.trajectory(value=value, error=error, name=name)
