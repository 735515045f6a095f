"""A server that answers with an enormous or endless body (hostile, or a bug that streams forever):
the client stops reading at `max_response_bytes` and raises an `EngineError` naming the endpoint,
instead of growing the trainer's process until it is killed for memory. Normal answers pass."""

from __future__ import annotations

import resource
from typing import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agentloop.engine.base import EngineError, SamplingParams
from agentloop.engine.sglang import SGLangClient

CHUNK = b"x" * (1 << 16)
GENERATE_REPLY = {"output_ids": [7], "meta_info": {
    "id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 2, "weight_version": "v",
    "output_token_logprobs": [[-0.5, 7, None]], "completion_tokens": 1}}


async def endless(request: web.Request) -> web.StreamResponse:
    """Chunked, no Content-Length, never ends (until the client goes away)."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    while True:
        await resp.write(CHUNK)


async def declared_huge(request: web.Request) -> web.StreamResponse:
    """Declares 64 GiB and starts sending them."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": str(64 << 30)})
    await resp.prepare(request)
    for _ in range(64):
        await resp.write(CHUNK)
    return resp


async def generate(request: web.Request) -> web.Response:
    return web.json_response(GENERATE_REPLY)


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/model_info", endless)
    app.router.add_get("/server_info", declared_huge)
    app.router.add_post("/flush_cache", endless)
    app.router.add_post("/generate", generate)
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    yield str(srv.make_url("")).rstrip("/")
    await srv.close()


async def test_endless_and_declared_huge_bodies_are_refused_naming_the_endpoint(server: str) -> None:
    client = SGLangClient(server, timeout=30, retries=0)
    client.max_response_bytes = 1 << 20
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with pytest.raises(EngineError, match=r"/model_info.*too large \(more than \d+ bytes so far; the limit is 1048576"):
            await client.model_info()
        with pytest.raises(EngineError, match=r"/server_info.*too large \(68719476736 bytes declared"):
            await client.server_info()
        with pytest.raises(EngineError, match=r"/flush_cache.*too large"):
            await client.flush_cache()
        # the client still works for a normal answer (the cut connections were not reused)
        out = await client.generate([1, 2], SamplingParams(max_new_tokens=1))
        assert out.output_ids == [7]
    finally:
        await client.close()
    # nothing near the endless body was kept (ru_maxrss is KiB on Linux)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 200 * 1024
