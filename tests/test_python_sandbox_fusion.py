"""The `python` tool's SandboxFusion backend (`sandbox: sandbox_fusion`), against a local HTTP service that
answers like SandboxFusion's `/run_code`: the request it sends, a run that finished, failed or hit the
service's time limit, and — as tool failures, never a crash — our own timeout, HTTP errors, a body that is
not SandboxFusion's JSON, the service's SandboxError and an unreachable service. Also selected from YAML."""

from __future__ import annotations

import json
import socket

import anyio
import pytest
from aiohttp import web

from agentloop.tools import ToolContext, ToolError, ToolRegistry
from agentloop.tools.builtin.python import PythonTool
from agentloop.tools.parsers import ToolCall

pytestmark = pytest.mark.timeout(60)


def result(stdout="", stderr="", return_code=0, run_status="Finished", status=None, message=""):
    return {"status": status or ("Success" if return_code == 0 and run_status == "Finished" else "Failed"),
            "message": message, "compile_result": None,
            "run_result": {"status": run_status, "execution_time": 0.01, "return_code": return_code,
                           "stdout": stdout, "stderr": stderr},
            "executor_pod_name": None, "files": {}}


@pytest.fixture
async def service():
    """A fake SandboxFusion: `answers` maps a marker in the code to the response to give."""
    state = {"requests": [], "answers": {}}

    async def run_code(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state["requests"].append(body)
        for marker, answer in state["answers"].items():
            if marker in body["code"]:
                if callable(answer):
                    return await answer()
                return answer
        return web.json_response(result(stdout="ran\n"))

    app = web.Application()
    app.router.add_post("/run_code", run_code)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state["url"] = f"http://127.0.0.1:{port}/run_code"
    yield state
    await runner.cleanup()


async def run(tool: PythonTool, code: str) -> str:
    return await tool.execute({"code": code}, ToolContext("t"))


async def test_request_and_results(service):
    tool = PythonTool(sandbox="sandbox_fusion", sandbox_fusion_url=service["url"], timeout=7, memory_mb=256)
    service["answers"]["ok"] = web.json_response(result(stdout="42\n"))
    assert await run(tool, "print(42)  # ok") == "42"
    req = service["requests"][-1]
    assert req["code"] == "print(42)  # ok" and req["language"] == "python" and req["run_timeout"] == 7
    assert req["memory_limit_MB"] == 256 and req["files"] == {} and req["fetch_files"] == []
    service["answers"]["fails"] = web.json_response(result(stderr="Traceback ...\nZeroDivisionError", return_code=1))
    assert (await run(tool, "1/0  # fails")).endswith("ZeroDivisionError\n(exit status 1)")
    service["answers"]["slow"] = web.json_response(result(stdout="partial\n", return_code=None, run_status="TimeLimitExceeded"))
    with pytest.raises(ToolError, match="(?s)timed out after 7 seconds.*partial") as e:
        await run(tool, "while True: pass  # slow")
    assert e.value.kind == "timeout"
    service["answers"]["chatty"] = web.json_response(result(stdout="x" * 5000))
    capped = PythonTool(sandbox="sandbox_fusion", sandbox_fusion_url=service["url"], max_output_bytes=100)
    assert await run(capped, "# chatty") == "x" * 100 + "\n...(stdout truncated: 4900 more bytes)"


async def test_service_failures_are_tool_errors(service, monkeypatch):
    from agentloop.tools.sandbox import fusion

    tool = PythonTool(sandbox="sandbox_fusion", sandbox_fusion_url=service["url"], timeout=1)
    cases = {
        "http500": (web.Response(status=500, text="boom"), "HTTP 500.*boom"),
        "notjson": (web.Response(text="<html>"), "not JSON"),
        "badshape": (web.json_response({"hello": 1}), "malformed response"),
        "badrc": (web.json_response(result(return_code="zero")), "malformed response: return_code"),
        "sandboxerror": (web.json_response(result(status="SandboxError", message="runner crashed")), "sandbox service error: runner crashed"),
    }
    for marker, (answer, pattern) in cases.items():
        service["answers"][marker] = answer
        with pytest.raises(ToolError, match=pattern):
            await run(tool, f"# {marker}")

    async def hang() -> web.Response:
        await anyio.sleep(3)  # longer than the client waits; short so the server's cleanup is quick
        return web.json_response(result())

    monkeypatch.setattr(fusion, "GRACE_SECONDS", 0.5)
    service["answers"]["hang"] = hang
    with pytest.raises(ToolError, match="did not answer within 1.5 seconds") as e:
        await run(tool, "# hang")
    assert e.value.kind == "timeout"
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/run_code"
    with pytest.raises(ToolError, match="unreachable"):
        await run(PythonTool(sandbox="sandbox_fusion", sandbox_fusion_url=dead), "print(1)")


async def test_selected_in_the_tools_yaml(service, tmp_path):
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(json.dumps({"tools": [{"class_name": "agentloop.tools.builtin.python.PythonTool",
                                          "config": {"sandbox": "sandbox_fusion", "sandbox_fusion_url": service["url"]}}]}))
    reg = ToolRegistry.from_yaml(cfg)
    service["answers"]["http500"] = web.Response(status=500, text="down")
    res = await reg.execute_calls([ToolCall("python", {"code": "print(1)"}, ""), ToolCall("python", {"code": "# http500"}, "")],
                                  context=ToolContext("t"), timeout=30, max_parallel=2)
    assert res[0].ok and res[0].content == "ran"
    assert not res[1].ok and res[1].error_kind == "exception" and "HTTP 500" in res[1].content
