"""Client of a SandboxFusion-compatible code sandbox service (the `/run_code` API that verl's
SandboxFusionTool calls), for people who already run one.

Request: `POST <url>` with `{"code", "language": "python", "run_timeout", "compile_timeout",
"memory_limit_MB", "stdin", "files": {}, "fetch_files": []}`. Answer: `{"status": "Success" | "Failed" |
"SandboxError", "message", "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error",
"return_code", "stdout", "stderr", "execution_time"}, ...}`. A program that ran (even one that failed or
hit the service's time limit) becomes a `SandboxOutput` like a local run; everything else — connection
errors, HTTP errors, our own timeout, a body that is not that JSON, the service's own `SandboxError` —
raises a ToolError that says which, so the registry reports it as this call's failure.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import anyio

from ..base import ToolError
from .process import SandboxOutput

__all__ = ["run_fusion"]

# Seconds on top of the run timeout for the service's queueing, start-up and the HTTP round trip.
GRACE_SECONDS = 10.0
_RUN_STATUSES = ("Finished", "TimeLimitExceeded", "Error")


def _capped(text: Any, cap: int, where: str) -> tuple[str, int]:
    if text is None:
        return "", 0
    if not isinstance(text, str):
        raise ToolError(f"sandbox service returned a malformed response: {where} is {type(text).__name__}, not a string")
    data = text.encode("utf-8", "replace")
    return data[:cap].decode("utf-8", "replace"), max(0, len(data) - cap)


def _parse(body: Any, cap: int, seconds: float) -> SandboxOutput:
    if not isinstance(body, dict) or body.get("status") not in ("Success", "Failed", "SandboxError"):
        raise ToolError(f"sandbox service returned a malformed response: {str(body)[:200]!r}")
    run = body.get("run_result")
    if body["status"] == "SandboxError" or (isinstance(run, dict) and run.get("status") == "Error"):
        message = str(body.get("message") or (run or {}).get("stderr") or "no message")
        raise ToolError(f"sandbox service error: {message[:500]}")
    if not isinstance(run, dict) or run.get("status") not in _RUN_STATUSES:
        compile_result = body.get("compile_result")
        if isinstance(compile_result, dict):  # (python is not compiled; a compile step that failed says why)
            raise ToolError(f"sandbox service could not run the code: {str(compile_result.get('stderr'))[:500]}")
        raise ToolError(f"sandbox service returned a malformed response: run_result is {str(run)[:200]!r}")
    rc = run.get("return_code")
    if rc is not None and (not isinstance(rc, int) or isinstance(rc, bool)):
        raise ToolError(f"sandbox service returned a malformed response: return_code is {rc!r}")
    stdout, out_dropped = _capped(run.get("stdout"), cap, "run_result.stdout")
    stderr, err_dropped = _capped(run.get("stderr"), cap, "run_result.stderr")
    return SandboxOutput(stdout=stdout, stderr=stderr, returncode=rc, seconds=seconds,
                         timed_out=run["status"] == "TimeLimitExceeded", stdout_dropped=out_dropped,
                         stderr_dropped=err_dropped)


async def run_fusion(url: str, code: str, *, timeout: float, memory_mb: int, max_output_bytes: int) -> SandboxOutput:
    """Run `code` on the service at `url` (the full `/run_code` URL)."""
    payload = {"code": code, "language": "python", "run_timeout": timeout, "compile_timeout": timeout,
               "memory_limit_MB": memory_mb, "stdin": "", "files": {}, "fetch_files": []}
    t0 = time.monotonic()
    limit = timeout + GRACE_SECONDS
    try:
        with anyio.fail_after(limit):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=limit)) as session:
                async with session.post(url, json=payload, headers={"Accept": "application/json"}) as resp:
                    text = await resp.text(errors="replace")
                    if resp.status != 200:
                        raise ToolError(f"sandbox service error: HTTP {resp.status} from {url}: {text[:300]}")
                    try:
                        body = await resp.json(content_type=None)
                    except ValueError:
                        raise ToolError(f"sandbox service returned a malformed response (not JSON): {text[:200]!r}") from None
    except TimeoutError:
        raise ToolError(f"sandbox service at {url} did not answer within {limit:g} seconds", kind="timeout") from None
    except aiohttp.ClientError as e:
        raise ToolError(f"sandbox service at {url} unreachable: {type(e).__name__}: {e}") from None
    return _parse(body, max_output_bytes, time.monotonic() - t0)
