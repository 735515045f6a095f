"""`agentloop serve` under concurrent weight updates (issue 29, item 4), as a real subprocess: one weight
update at a time (a second waits at most --weight-update-wait, then 409 with a message; its body is
not read meanwhile), a bound on the body bytes held over all requests (429 past it), and with four
concurrent large bodies the server's peak RSS stays near one body's worth while /health answers
promptly. Scaled down from the issue's ~1 GiB bodies (RSS 5.7 / 7.7 GB with two / four) to 48 MiB."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

MB = 1 << 20
BODY = 48 * MB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(random_model_dir: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    src = Path(__file__).resolve().parents[1] / "src"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentloop", "serve", "--model", str(random_model_dir), "--port", str(port),
         "--max-weights-request-bytes", str(64 * MB), "--max-held-request-bytes", str(80 * MB),
         "--weight-update-wait", "3", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(src)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if health(url) < 2:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
            time.sleep(0.3)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def health(url: str) -> float:
    t0 = time.monotonic()
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        assert r.status == 200
    return time.monotonic() - t0


def post(url: str, path: str, data: bytes, timeout: float = 120) -> tuple[int, Any]:
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def declare(url: str, path: str, length: int) -> socket.socket:
    """A request whose body is announced and only begun: its handler waits on the rest."""
    port = int(url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {length}\r\n\r\n".encode() + b'{"x": "')
    return s


def vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def weights_body() -> bytes:
    return json.dumps({"serialized_named_tensors": ["A" * BODY], "flush_cache": False}).encode()


def test_a_second_weight_update_waits_then_gets_409_with_a_message(server: tuple[str, int]) -> None:
    url, _ = server
    first = declare(url, "/update_weights_from_tensor", 40 * MB)  # holds the update slot while it "uploads"
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        status, body = post(url, "/update_weights_from_tensor", b'{"serialized_named_tensors": []}')
        waited = time.monotonic() - t0
        assert status == 409 and body["success"] is False, (status, body)
        assert "another weight update is in progress" in body["message"] and "--weight-update-wait" in body["message"]
        assert 2.5 < waited < 10, waited
        assert health(url) < 1.0
    finally:
        first.close()
    time.sleep(0.5)
    status, body = post(url, "/update_weights_from_tensor", b'{"serialized_named_tensors": []}')
    assert status != 409, body  # the slot is free again once the first one's client went away


def test_bytes_held_over_concurrent_bodies_are_bounded(server: tuple[str, int]) -> None:
    url, _ = server
    held = [declare(url, "/generate", 13 * MB) for _ in range(6)]  # 78 of the 80 MiB allowed at once
    try:
        time.sleep(0.5)
        status, body = post(url, "/generate", json.dumps({"input_ids": [1] * (3 * MB // 2),
                                                          "sampling_params": {"max_new_tokens": 1}}).encode())
        assert status == 429, (status, body)
        assert "--max-held-request-bytes" in json.dumps(body), body
        assert health(url) < 1.0
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    status, body = post(url, "/generate", json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}).encode())
    assert status == 200, body  # given back when those requests ended


@pytest.mark.slow
def test_four_concurrent_weight_bodies_keep_rss_near_one_body_and_health_prompt(server: tuple[str, int]) -> None:
    url, pid = server
    data = weights_body()
    status, _ = post(url, "/update_weights_from_tensor", data)  # one alone: what one body costs
    assert status == 400  # not real tensors: refused for its content, after being read and decoded
    one = vm(pid, "VmHWM")
    results: list[tuple[int, Any]] = []
    lat: list[float] = []
    stop = threading.Event()

    def poll_health() -> None:
        while not stop.is_set():
            lat.append(health(url))
            time.sleep(0.1)

    threads = [threading.Thread(target=lambda: results.append(post(url, "/update_weights_from_tensor", data)))
               for _ in range(4)]
    hp = threading.Thread(target=poll_health)
    hp.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    stop.set()
    hp.join(60)
    four = vm(pid, "VmHWM")
    statuses = sorted(s for s, _ in results)
    assert len(statuses) == 4 and set(statuses) <= {400, 409}, results  # each read alone, or refused unread
    grew = four - one
    print(f"peak RSS after one body {one / MB:.0f} MiB, after four concurrent {four / MB:.0f} MiB (+{grew / MB:.0f}); "
          f"health max {max(lat):.2f}s over {len(lat)} polls; statuses {statuses}")
    assert grew < 2 * BODY, grew / MB  # main: the four bodies were held together (+3 bodies or more)
    assert max(lat) < 1.0, max(lat)
