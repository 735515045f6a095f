"""The client's reachability log: a server never reached yet (a launched server still starting, a wrong
URL) is not warned about, since its caller reports the same error (or waits for the start); a server
that answered and then stops is warned about once, and its return is said once."""

from __future__ import annotations

import logging
import socket

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agentloop.engine.base import EngineError
from agentloop.engine.sglang import SGLangClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def model_info(request: web.Request) -> web.Response:
    return web.json_response({"model_path": "/m", "weight_version": "v"})


def warnings_about(caplog: pytest.LogCaptureFixture, url: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and url in r.getMessage()]


async def test_not_yet_reachable_is_quiet_a_lost_server_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="agentloop")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    client = SGLangClient(url, timeout=5, retries=0)
    try:
        for _ in range(3):  # polled while "starting": nothing listens yet
            with pytest.raises(EngineError, match="cannot connect"):
                await client.model_info()
        assert warnings_about(caplog, url) == []
        app = web.Application()
        app.router.add_get("/model_info", model_info)
        srv = TestServer(app, host="127.0.0.1", port=port)
        await srv.start_server()
        assert (await client.model_info())["model_path"] == "/m"  # up: no "reachable again" (never lost)
        assert not [r for r in caplog.records if "reachable again" in r.getMessage()]
        await srv.close()
        await client.close()  # a fresh connection next time (the old one was closed with the server)
        for _ in range(3):
            with pytest.raises(EngineError, match="cannot connect"):
                await client.model_info()
        lost = warnings_about(caplog, url)
        assert len(lost) == 1 and lost[0].startswith(f"engine server {url} unreachable: cannot connect"), lost
    finally:
        await client.close()
