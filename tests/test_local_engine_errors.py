"""Bad input to the CPU engine gets a 4xx with a message naming what is wrong, and the server keeps
serving. Driven with raw aiohttp so the requests are exactly what a careless client could send
(the SGLang client refuses some of them before sending)."""

from __future__ import annotations

import asyncio
import base64
import pickle
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import save, save_file

PROMPT = [5, 6, 7, 8, 9]


async def post(url: str, path: str, body: Any = None, *, raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        kw: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with s.post(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=30), **kw) as r:
            text = await r.text()
            try:
                return r.status, await r.json(content_type=None)
            except ValueError:
                return r.status, text


async def assert_serving(url: str) -> None:
    status, body = await post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(body["output_ids"]) == 2, body


def message(body: Any) -> str:
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict):
            return body["error"]["message"]
        return str(body.get("message", body))
    return str(body)


GENERATE_CASES = [
    ({"input_ids": [1, 2, 10_000]}, "input_ids[2]=10000 is out of vocabulary"),
    ({"input_ids": [1, -3]}, "input_ids[1]=-3 is out of vocabulary"),
    ({"input_ids": [1, "a"]}, "input_ids[1]='a' is not an integer"),
    ({"input_ids": []}, "non-empty list"),
    ({"input_ids": [[1, 2], [3, 99999]]}, "input_ids[1][1]"),
    ({"sampling_params": {"max_new_tokens": 4}}, "Either text, input_ids or input_embeds should be provided."),
    ({"text": "hello"}, "send input_ids"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "min_p"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temprature": 0.5}}, "unknown field(s) ['temprature']"),
    ({"input_ids": [1], "sampling_params": {"stop": ["\n"]}}, "stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [1, 50_000]}}, "stop_token_ids [50000]"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 2.5}}, "frequency_penalty must be in [-2, 2]"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty must be in (0, 2]"),
    ({"input_ids": [1], "sampling_params": {"logit_bias": {"50000": 1.0}}}, "logit_bias must has keys in"),
    ({"input_ids": [1], "sampling_params": {"stop_regex": "a+"}}, "stop_regex"),
    ({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 100_000}},
     "Requested token count exceeds the model's maximum context length"),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "regex"),
    ({"input_ids": [1], "sampling_params": "greedy"}, "sampling_params must be an object"),
    ({"input_ids": [1], "top_logprobs_num": -2, "return_logprob": True}, "top_logprobs_num"),
    ({"input_ids": [1, 2], "logprob_start_len": 5, "return_logprob": True}, "logprob_start_len"),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "unique"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "batch has 2"),
    ({"input_ids": [1] * 5000}, "context length"),
]


@pytest.mark.parametrize("body,needle", GENERATE_CASES, ids=[c[1][:30] for c in GENERATE_CASES])
async def test_bad_generate_requests_get_400(local_engine: str, body: dict, needle: str) -> None:
    status, resp = await post(local_engine, "/generate", body)
    assert status == 400, resp
    assert needle in message(resp)


async def test_malformed_bodies_get_400(local_engine: str) -> None:
    for path in ("/generate", "/update_weights_from_disk", "/abort_request", "/release_memory_occupation"):
        status, resp = await post(local_engine, path, raw=b'{"input_ids": [1, 2')
        assert status == 400 and "malformed JSON" in message(resp), (path, resp)
    status, resp = await post(local_engine, "/generate", [1, 2, 3])
    assert status == 400 and "must be an object" in message(resp)
    await assert_serving(local_engine)


async def test_bad_control_requests_get_400(local_engine: str) -> None:
    cases = [
        ("/release_memory_occupation", {"tags": ["weights", "gpu"]}, "unknown memory tag(s) ['gpu']"),
        ("/release_memory_occupation", {"tags": "weights"}, "tags must be a list"),
        ("/resume_memory_occupation", {"tags": ["weights"]}, "not released"),
        ("/resume_memory_occupation", {"tags": ["kv"]}, "unknown memory tag(s) ['kv']"),
        ("/pause_generation", {"mode": "sleep"}, "mode must be one of"),
        ("/abort_request", {"rid": 5}, "rid must be a string"),
        ("/abort_request", {"abort_all": "yes"}, "abort_all must be a boolean"),
    ]
    for path, body, needle in cases:
        status, resp = await post(local_engine, path, body)
        assert status == 400, (path, resp)
        assert needle in message(resp), (path, resp)
    await assert_serving(local_engine)


async def test_bad_weight_updates_get_400_and_change_nothing(local_engine: str, random_model_dir: Path, tmp_path: Path) -> None:
    greedy = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "return_logprob": True}
    _, before = await post(local_engine, "/generate", greedy)
    good = torch.zeros(64)  # model.norm.weight of the 64-wide model
    bad_shape = {"model.norm.weight": torch.zeros(65)}
    bad_name = {"model.norm.weight": good, "model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)}

    def b64(tensors: dict) -> str:
        return base64.b64encode(save(tensors)).decode()

    cases = [
        ({"serialized_named_tensors": [b64(bad_shape)]}, "'model.norm.weight' has shape [65]"),
        ({"serialized_named_tensors": [b64(bad_name)]}, "'model.layers.9.mlp.up_proj.weight' does not match"),
        # NaN/Inf used to be taken, and then every sampled generate answered 500.
        ({"serialized_named_tensors": [b64({"model.norm.weight": torch.full((64,), float("nan"))})]},
         "tensor 'model.norm.weight' holds 64 NaN and 0 Inf value(s)"),
        ({"serialized_named_tensors": [b64({"model.norm.weight": good.clone().index_fill_(0, torch.tensor([3]), float("-inf")),
                                            "model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64)})]},
         "tensor 'model.norm.weight' holds 0 NaN and 1 Inf value(s)"),
        ({"serialized_named_tensors": [base64.b64encode(pickle.dumps([("model.norm.weight", good)])).decode()]},
         "only safetensors payloads"),
        ({"serialized_named_tensors": ["%%% not base64 %%%"]}, "only safetensors payloads"),
        ({"serialized_named_tensors": [{"model.norm.weight": [0.0]}]}, "only safetensors payloads"),
        ({"serialized_named_tensors": []}, "non-empty list"),
        ({}, "serialized_named_tensors is required"),
        ({"serialized_named_tensors": [b64({"model.norm.weight": good})], "load_format": "flattened_bucket"}, "load_format"),
    ]
    for body, needle in cases:
        status, resp = await post(local_engine, "/update_weights_from_tensor", body)
        assert status == 400 and resp["success"] is False, resp
        assert needle in resp["message"], resp

    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    save_file(bad_shape, str(bad_dir / "model.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors at all")
    (tmp_path / "empty").mkdir()
    disk_cases = [
        ({"model_path": str(bad_dir)}, "has shape [65]"),
        ({"model_path": str(tmp_path / "missing")}, "no such file or folder"),
        ({"model_path": str(tmp_path / "junk.safetensors")}, "not a readable safetensors file"),
        ({"model_path": str(tmp_path / "empty")}, "no *.safetensors files"),
        ({}, "model_path must be a non-empty string"),
    ]
    for body, needle in disk_cases:
        status, resp = await post(local_engine, "/update_weights_from_disk", body)
        assert status == 400 and resp["success"] is False, resp
        assert needle in resp["message"], resp

    # All or nothing: the half-valid updates above wrote nothing and left the version alone.
    _, after = await post(local_engine, "/generate", greedy)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert after["meta_info"]["weight_version"] == "default"


async def test_update_refused_while_weights_released(local_engine: str, random_model_dir: Path) -> None:
    assert (await post(local_engine, "/release_memory_occupation", {"tags": ["weights"]}))[0] == 200
    try:
        status, resp = await post(local_engine, "/update_weights_from_disk", {"model_path": str(random_model_dir)})
        assert status == 400 and "resume_memory_occupation" in resp["message"]
        status, resp = await post(local_engine, "/generate", {"input_ids": PROMPT})
        assert status == 503 and "weights" in message(resp)
    finally:
        assert (await post(local_engine, "/resume_memory_occupation", {"tags": ["weights"]}))[0] == 200
        status, resp = await post(local_engine, "/update_weights_from_disk", {"model_path": str(random_model_dir)})
        assert status == 200 and resp["success"], resp
    await assert_serving(local_engine)


async def test_release_refused_while_requests_run_and_duplicate_rid(local_engine: str) -> None:
    long = {"input_ids": PROMPT, "rid": "dup", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    task = asyncio.create_task(post(local_engine, "/generate", long))
    try:
        for _ in range(500):
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{local_engine}/server_info") as r:
                    if (await r.json())["internal_states"][0]["num_running"]:
                        break
            await asyncio.sleep(0.01)
        status, resp = await post(local_engine, "/generate", long)
        assert status == 400 and "already in flight" in message(resp)
        status, resp = await post(local_engine, "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert status == 400 and "running" in message(resp)
        assert (await post(local_engine, "/abort_request", {"rid": "dup"}))[0] == 200
        status, resp = await asyncio.wait_for(task, 10)
    finally:
        task.cancel()
    assert status == 200 and resp["meta_info"]["finish_reason"]["type"] == "abort"
    await assert_serving(local_engine)


async def test_client_disconnect_aborts_its_request(local_engine: str) -> None:
    long = {"input_ids": PROMPT, "rid": "gone", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with pytest.raises(asyncio.TimeoutError):
        async with aiohttp.ClientSession() as s:
            await s.post(f"{local_engine}/generate", json=long, timeout=aiohttp.ClientTimeout(total=0.3))
    for _ in range(200):
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{local_engine}/server_info") as r:
                if (await r.json())["internal_states"][0]["num_running"] == 0:
                    break
        await asyncio.sleep(0.02)
    else:
        pytest.fail("the request of a client that went away kept decoding")
    await assert_serving(local_engine)


async def test_health_and_info_endpoints(local_engine: str) -> None:
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/health_generate"):
            async with s.get(f"{local_engine}{path}") as r:
                assert r.status == 200, path
        async with s.get(f"{local_engine}/server_info") as r:
            info = await r.json()
        assert info["tensor_transport"] == "safetensors" and info["context_length"] == 4096
        async with s.get(f"{local_engine}/model_info") as r:
            mi = await r.json()
        assert mi["is_generation"] is True and mi["weight_version"] == "default"
        async with s.get(f"{local_engine}/no_such_endpoint") as r:
            assert r.status == 404


async def _get(url: str, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, await r.text()


async def test_lifecycle_misuse_that_kills_sglang_is_refused_and_says_so(local_engine: str) -> None:
    """SGLang 0.5.17 dies on a double release (torch_memory_saver: "Cannot pause allocation that is not
    active"), on a resume of resident memory (KeyError) and on a generate or /health on released memory.
    The CPU engine refuses each, names the tags, says SGLang would crash, changes nothing and serves on
    — over two release/resume cycles."""
    crash = "real SGLang 0.5.17 would crash here"
    for _ in range(2):
        status, resp = await post(local_engine, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert status == 400 and "['kv_cache']: not released" in message(resp) and crash in message(resp), resp
        assert (await post(local_engine, "/release_memory_occupation", {"tags": ["kv_cache"]}))[0] == 200
        try:
            for tags in (["kv_cache"], ["weights", "kv_cache"], None):
                status, resp = await post(local_engine, "/release_memory_occupation", {"tags": tags} if tags else {})
                assert status == 400 and "['kv_cache']: already released" in message(resp), (tags, resp)
                assert crash in message(resp) and "Cannot pause allocation that is not active" in message(resp)
            # The refused releases released nothing else: weights are resident, resuming them is misuse too.
            status, resp = await post(local_engine, "/resume_memory_occupation", {"tags": ["weights"]})
            assert status == 400 and "not released" in message(resp) and crash in message(resp), resp
            status, resp = await post(local_engine, "/generate", {"input_ids": PROMPT})
            assert status == 503 and "kv_cache" in message(resp) and crash in message(resp), resp
            for path in ("/health", "/health_generate"):
                status, text = await _get(local_engine, path)
                assert status == 503 and crash in text, (path, text)
            status, text = await _get(local_engine, "/model_info")  # the safe probe still answers
            assert status == 200, text
        finally:
            assert (await post(local_engine, "/resume_memory_occupation", {"tags": ["kv_cache"]}))[0] == 200
        await assert_serving(local_engine)
        assert (await _get(local_engine, "/health"))[0] == 200
