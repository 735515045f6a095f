"""SGLangClient.generate's inputs beyond `SamplingParams` (issue 2 audit): a plain SGLang
`sampling_params` dict, `seed` as an alias of SGLang's `sampling_seed`, and the optional
`logprob_start_len` / `top_logprobs_num` passthrough — checked on the wire against a recorder, and
end to end against `agentloop serve`. Also `agentloop serve --model-path DIR --port 0`."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agentloop.engine.base import SamplingParams
from agentloop.engine.sglang import SGLangClient

ANSWER = {"output_ids": [7], "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": 1},
                                           "weight_version": "default", "output_token_logprobs": [[-0.5, 7, None]]}}


@pytest.fixture
async def recorder():
    bodies: list[Any] = []

    async def handle(request: web.Request) -> web.Response:
        bodies.append(json.loads(await request.read()))
        return web.json_response(ANSWER)

    app = web.Application()
    app.router.add_post("/generate", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), bodies
    finally:
        await server.close()


def test_seed_is_an_alias_of_sampling_seed() -> None:
    assert SamplingParams(seed=3).sampling_seed == 3
    assert "seed" not in SamplingParams(seed=3).to_json() and SamplingParams(seed=3).to_json()["sampling_seed"] == 3
    assert SamplingParams(seed=3).replace(temperature=0.5).sampling_seed == 3
    with pytest.raises(ValueError, match="disagree"):
        SamplingParams(seed=1, sampling_seed=2)


async def test_dict_sampling_params_and_logprob_passthrough_on_the_wire(recorder) -> None:
    url, bodies = recorder
    async with SGLangClient(url, timeout=5) as client:
        out = await client.generate([1, 2], {"max_new_tokens": None, "seed": 9, "repetition_penalty": 1.2},
                                    rid="d", logprob_start_len=0, top_logprobs_num=2)
        await client.generate([1, 2], SamplingParams(max_new_tokens=1), rid="e")
        with pytest.raises(TypeError):
            await client.generate([1, 2], "greedy", rid="f")  # type: ignore[arg-type]
    assert out.output_ids == [7]
    first, second = bodies
    assert first["sampling_params"]["sampling_seed"] == 9 and "seed" not in first["sampling_params"]
    assert first["sampling_params"]["max_new_tokens"] is None  # explicit null: until the context ends
    assert first["sampling_params"]["repetition_penalty"] == 1.2
    assert first["logprob_start_len"] == 0 and first["top_logprobs_num"] == 2
    assert "logprob_start_len" not in second and "top_logprobs_num" not in second


async def test_dict_params_against_the_cpu_engine(local_engine: str) -> None:
    async with SGLangClient(local_engine) as client:
        a = await client.generate([5, 6, 7], {"max_new_tokens": 6, "temperature": 1.0, "seed": 4}, logprob_start_len=0)
        b = await client.generate([5, 6, 7], SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=4))
        assert a.output_ids == b.output_ids and len(a.output_ids) == 6
        assert len(a.raw_meta["input_token_logprobs"]) == 3  # prompt logprobs from position 0


def test_serve_port_zero_logs_the_bound_port_and_accepts_model_path(random_model_dir: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentloop.cli", "serve", "--model-path", str(random_model_dir), "--port", "0",
         "--num-threads", "1"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    try:
        port = None
        assert proc.stderr is not None
        for line in proc.stderr:
            m = re.search(r"serving on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port and port != 0, "the log did not name the bound port"

        async def probe() -> dict[str, Any]:
            async with aiohttp.ClientSession() as s:
                for _ in range(200):
                    try:
                        async with s.get(f"http://127.0.0.1:{port}/model_info") as r:
                            return await r.json()
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.05)
            raise AssertionError("no answer on the logged port")

        assert asyncio.run(probe())["model_path"] == str(random_model_dir)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_flush_cache_timeout_waits_on_the_server(local_engine: str) -> None:
    async with SGLangClient(local_engine) as client:
        # 1500 tokens: still running when the first flush arrives, however fast the machine
        task = asyncio.create_task(client.generate([5, 6, 7], {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}))
        for _ in range(500):
            if (await client.server_info())["internal_states"][0]["num_running"]:
                break
            await asyncio.sleep(0.005)
        assert await client.flush_cache() is False  # busy, no timeout: refused at once
        assert await client.flush_cache(timeout=30) is True  # the server waited for idle
        state = (await client.server_info())["internal_states"][0]
        assert state["num_running"] == 0 and state["num_waiting"] == 0
        assert len((await asyncio.wait_for(task, 30)).output_ids) == 1500


async def test_launch_facts_are_asked_once(local_engine: str) -> None:
    """Vocabulary size, transport and TP size come from one /server_info answer, however many lookups."""
    class Counting(SGLangClient):
        asked = 0

        async def server_info(self) -> dict:
            Counting.asked += 1
            return await super().server_info()

    async with Counting(local_engine) as c:
        await c.prepare()
        assert await c.served.resolve_tensor_transport() == "safetensors" and isinstance(await c.served.resolve_vocab_size(), int)
        assert c.served.tp_size == 1 and Counting.asked == 1
        await c.server_info()  # a direct call still asks the server (its internal_states change)
        assert Counting.asked == 2
