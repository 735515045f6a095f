"""Issue 15, `agentloop serve` as a real subprocess: request-size limits by endpoint (small for
generate, large only for weight payloads; a declared Content-Length over the limit is refused before
the body is read, and /health keeps answering), limits on `n` and on the total work of one request,
4xx for malformed bodies (a 100k-deep nested JSON body included), all documented in `--help`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from typing import Any, Callable
from urllib.parse import urlparse

import pytest

MB = 1 << 20
LIMIT_ARGS = ["--max-request-bytes", str(MB), "--max-weights-request-bytes", str(8 * MB),
              "--max-n", "16", "--max-request-tokens", "20000"]


@pytest.fixture(scope="module")
def engine(start_local_engine: Callable[..., str], random_model_dir: Any) -> str:
    return start_local_engine(random_model_dir, LIMIT_ARGS)


def post(url: str, path: str, data: bytes, timeout: float = 60) -> tuple[int, Any]:
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def health(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return r.status


def message(body: Any) -> str:
    return body.get("message") or body.get("error", {}).get("message", "")


def test_a_100k_deep_nested_body_is_a_400_not_a_500(engine: str) -> None:
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        for path in ("/generate", "/update_weights_from_tensor", "/abort_request"):
            status, body = post(engine, path, raw)
            assert status == 400, (path, status, body)
            assert "nested too deeply" in message(body)
    assert health(engine) == 200


def test_body_size_limits_are_by_endpoint(engine: str) -> None:
    big = json.dumps({"input_ids": [1] * (MB // 2), "sampling_params": {"max_new_tokens": 1}}).encode()  # ~1.5 MB
    status, body = post(engine, "/generate", big)
    assert status == 413 and "--max-request-bytes" in message(body), (status, body)
    # The same size is accepted by the weight-payload endpoint (refused for its content, not its size).
    payload = json.dumps({"serialized_named_tensors": ["x" * (2 * MB)], "load_format": None}).encode()
    status, body = post(engine, "/update_weights_from_tensor", payload)
    assert status == 400 and body["success"] is False and "larger than" not in body["message"], (status, body)
    status, body = post(engine, "/update_weights_from_tensor", b'{"x": "' + b"y" * (9 * MB) + b'"}')
    assert status == 413 and "--max-weights-request-bytes" in body["message"]
    assert health(engine) == 200


def _declare(url: str, path: str, length: int) -> socket.socket:
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {length}\r\n\r\n".encode() + b"[1,")
    return s


def test_declared_huge_bodies_are_refused_unread_and_health_keeps_answering(engine: str) -> None:
    socks = [_declare(engine, "/generate", 1 << 30) for _ in range(3)]  # three 1 GiB bodies announced
    try:
        assert health(engine) == 200
        for s in socks:
            head = s.recv(4096).decode(errors="replace")
            assert head.startswith("HTTP/1.1 413"), head[:200]
    finally:
        for s in socks:
            s.close()
    assert health(engine) == 200


def test_n_and_total_work_per_request_are_limited(engine: str) -> None:
    status, body = post(engine, "/generate", json.dumps(
        {"input_ids": [1, 2, 3], "sampling_params": {"n": 100_000, "max_new_tokens": 4}}).encode())
    assert status == 400 and "sampling_params.n=100000" in message(body) and "--max-n" in message(body), body
    status, body = post(engine, "/generate", json.dumps(
        {"input_ids": [[1, 2, 3]] * 50, "sampling_params": {"n": 16, "max_new_tokens": 30}}).encode())
    assert status == 400 and "--max-request-tokens" in message(body), body
    status, body = post(engine, "/generate", json.dumps(
        {"input_ids": [1, 2, 3], "sampling_params": {"n": 4, "max_new_tokens": 2}}).encode())
    assert status == 200 and len(body) == 4
    assert health(engine) == 200


@pytest.mark.parametrize("raw", [b"[", b"\xff\xfe", b"[]", b"7", b'"s"', b'{"input_ids": "abc"}',
                                 b'{"input_ids": [1], "sampling_params": "hot"}', b'{"input_ids": [[]]}',
                                 b'{"input_ids": [1], "rid": 5}', b'{"input_ids": [1], "sampling_params": {"n": "2"}}'])
def test_malformed_generate_bodies_get_4xx(engine: str, raw: bytes) -> None:
    status, body = post(engine, "/generate", raw)
    assert 400 <= status < 500 and message(body), (status, body)


def test_serve_help_documents_the_limits() -> None:
    out = subprocess.run([sys.executable, "-m", "agentloop", "serve", "--help"], capture_output=True, text=True,
                         timeout=120).stdout
    for flag in ("--max-request-bytes", "--max-weights-request-bytes", "--max-n", "--max-request-tokens"):
        assert flag in out
    assert "/update_weights_from_tensor" in out and "413" in out and "never 500" in out
