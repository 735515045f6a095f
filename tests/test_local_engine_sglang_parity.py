"""The CPU engine behaves like sglang 0.5.17 where the acceptance audit found it did not (issue 7):
request normalisation (logprob_start_len, batch rids, n), SGLang's length rules, flush with its
body and timeout, HTTP methods and the weight-version endpoints, streaming errors, penalties over
HTTP, and weight updates that wait for the generates in flight (SGLang's model_update_lock).
Each expectation cites the sglang source it follows."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from safetensors.torch import load_file, save

from agentloop.models.random_model import make_random_model

PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def call(url: str, path: str, body: Any = None, *, method: str = "POST", timeout: float = 60) -> tuple[int, Any, str]:
    async with aiohttp.ClientSession() as s:
        kw = {} if body is None else {"json": body}
        async with s.request(method, url + path, timeout=aiohttp.ClientTimeout(total=timeout), **kw) as r:
            text = await r.text()
    try:
        return r.status, json.loads(text) if text else None, text
    except ValueError:
        return r.status, None, text


async def wait_running(url: str, n: int = 1) -> None:
    for _ in range(1000):
        _, info, _ = await call(url, "/server_info", method="GET")
        if info["internal_states"][0]["num_running"] >= n:
            return
        await asyncio.sleep(0.005)
    pytest.fail("the request never started decoding")


def payload(model_dir: Path) -> str:
    return base64.b64encode(save(load_file(str(model_dir / "model.safetensors")))).decode()


@pytest.fixture(scope="module")
def small_ctx(start_local_engine, random_model_dir: Path) -> str:
    return start_local_engine(random_model_dir, ["--context-length", "32"])


# ---- request normalisation ---------------------------------------------------------------------
async def test_logprob_start_len_rules(local_engine: str) -> None:
    # io_struct: null -> -1; scheduler: ignored without return_logprob, refused only when > input length
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    status, out, _ = await call(local_engine, "/generate", {**body, "return_logprob": True, "logprob_start_len": None})
    assert status == 200 and out["meta_info"]["input_token_logprobs"] == [] and out["meta_info"]["output_token_logprobs_length"] == 2
    status, out, _ = await call(local_engine, "/generate", {**body, "logprob_start_len": 99})
    assert status == 200 and "output_token_logprobs" not in out["meta_info"]
    status, out, _ = await call(local_engine, "/generate", {**body, "return_logprob": True, "logprob_start_len": len(PROMPT)})
    assert status == 200 and out["meta_info"]["input_token_logprobs"] == []
    status, out, _ = await call(local_engine, "/generate", {**body, "return_logprob": True, "logprob_start_len": len(PROMPT) + 1})
    assert status == 400 and "is higher than the number of input tokens" in out["error"]["message"]


async def test_batch_with_one_string_rid_gets_indexed_rids(local_engine: str) -> None:
    # io_struct._normalize_rid: f"{rid}_{i}" for a batch
    status, out, _ = await call(local_engine, "/generate", {"input_ids": [PROMPT, PROMPT[:3]], "rid": "job",
                                                           "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and [o["meta_info"]["id"] for o in out] == ["job_0", "job_1"]


async def test_n_expands_to_n_outputs(local_engine: str) -> None:
    # tokenizer_manager parallel sampling: a single input with n=3 answers a list of 3, rids f"{rid}_{uuid}"
    status, out, _ = await call(local_engine, "/generate", {"input_ids": PROMPT, "rid": "par",
                                                           "sampling_params": {"max_new_tokens": 3, "n": 3}})
    assert status == 200 and isinstance(out, list) and len(out) == 3
    rids = [o["meta_info"]["id"] for o in out]
    assert len(set(rids)) == 3 and all(r.startswith("par_") for r in rids)


async def test_the_rid_of_an_n_request_aborts_all_its_samples(local_engine: str) -> None:
    # tokenizer_manager.abort_request: a logical rid with parallel_sample_num > 1 aborts every child
    task = asyncio.create_task(call(local_engine, "/generate", {
        "input_ids": PROMPT, "rid": "many", "sampling_params": {"max_new_tokens": 3000, "n": 3, **GREEDY}}))
    try:
        await wait_running(local_engine, 3)
        status, _, _ = await call(local_engine, "/abort_request", {"rid": "many"})
        assert status == 200
        status, out, _ = await asyncio.wait_for(task, 30)
    finally:
        task.cancel()
    assert status == 200 and len(out) == 3
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in out)
    assert all(len(o["output_ids"]) < 3000 for o in out)


async def test_meta_info_and_sent_timestamp(local_engine: str) -> None:
    # tokenizer_manager: response_sent_to_client_ts on the first response sent for a request only
    before = time.time()
    status, out, _ = await call(local_engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    meta = out["meta_info"]
    assert status == 200 and before <= meta["response_sent_to_client_ts"] <= time.time()
    assert meta["reasoning_tokens"] == 0 and meta["cached_tokens_details"] is None and meta["dp_rank"] is None
    _, _, text = await call(local_engine, "/generate", {"input_ids": PROMPT, "stream": True,
                                                        "sampling_params": {"max_new_tokens": 200, **GREEDY}})
    chunks = [json.loads(ln[6:]) for ln in text.split("\n") if ln.startswith("data: {")]
    assert len(chunks) >= 2
    assert ["response_sent_to_client_ts" in c["meta_info"] for c in chunks] == [True] + [False] * (len(chunks) - 1)
    assert "e2e_latency" in chunks[-1]["meta_info"] and "e2e_latency" not in chunks[0]["meta_info"]


# ---- length rules ------------------------------------------------------------------------------
async def test_context_length_rules(small_ctx: str) -> None:
    # tokenizer_manager._validate_one_request refuses prompt + explicit max_new_tokens > context;
    # scheduler.init_req_max_new_tokens caps at (context - 1) - input - 1, null = no limit
    prompt = list(range(3, 13))  # 10 tokens, context 32
    status, out, _ = await call(small_ctx, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 23, **GREEDY}})
    assert status == 400 and out["error"]["message"] == (
        "Requested token count exceeds the model's maximum context length of 32 tokens. You requested a total of 33 "
        "tokens: 10 tokens from the input messages and 23 tokens for the completion. Please reduce the number of "
        "tokens in the input messages or the completion to fit within the limit.")
    for sp in ({"max_new_tokens": 22}, {"max_new_tokens": None}, {}):
        status, out, _ = await call(small_ctx, "/generate", {"input_ids": prompt, "sampling_params": {**sp, **GREEDY}})
        assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 20}, (sp, out)
    status, out, _ = await call(small_ctx, "/generate", {"input_ids": list(range(3, 35))})
    assert status == 400 and out["error"]["message"] == "The input (32 tokens) is longer than the model's context length (32 tokens)."


# ---- control endpoints -------------------------------------------------------------------------
async def test_flush_cache_body_and_timeout(local_engine: str) -> None:
    # http_server.flush_cache + scheduler_components/flush_wrapper.py
    long = asyncio.create_task(call(local_engine, "/generate", {"input_ids": PROMPT, "rid": "flush-busy",
                                                                "sampling_params": {"max_new_tokens": 3000, **GREEDY}}))
    try:
        await wait_running(local_engine)
        status, _, text = await call(local_engine, "/flush_cache")
        assert (status, text) == (400, "Flush cache failed.\n")
        status, _, text = await call(local_engine, "/flush_cache?timeout=0.05")
        assert (status, text) == (400, "Timed out waiting for idle state.")
        waiting = asyncio.create_task(call(local_engine, "/flush_cache?timeout=30", method="GET"))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await call(local_engine, "/abort_request", {"rid": "flush-busy"})
        status, _, text = await asyncio.wait_for(waiting, 30)
        assert status == 200 and text.startswith("Cache flushed.")
    finally:
        long.cancel()


async def test_methods_and_weight_version_endpoints(local_engine: str) -> None:
    status, out, _ = await call(local_engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}, method="PUT")
    assert status == 200 and len(out["output_ids"]) == 1
    for path in ("/get_weight_version", "/weight_version"):
        status, out, _ = await call(local_engine, path, method="GET")
        assert status == 404 and out == {"object": "error", "message": "Endpoint '/get_weight_version' or '/weight_version' "
                                          "is deprecated. Please use '/model_info' instead.", "type": "404", "param": None, "code": 404}
    assert (await call(local_engine, "/abort_request", {}))[0] == 200
    _, info, _ = await call(local_engine, "/model_info", method="GET")
    old = info["weight_version"]
    try:
        status, out, _ = await call(local_engine, "/update_weight_version", {"new_version": "renamed"})
        assert status == 200 and out == {"success": True, "message": "Weight version updated to renamed", "new_version": "renamed"}
        _, info, _ = await call(local_engine, "/model_info", method="GET")
        assert info["weight_version"] == "renamed"
        _, out, _ = await call(local_engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
        assert out["meta_info"]["weight_version"] == "renamed"
    finally:
        await call(local_engine, "/update_weight_version", {"new_version": old})
    # GET with an empty body releases / resumes everything, as SGLang's api_route(GET, POST)
    await call(local_engine, "/pause_generation", {"mode": "abort"})
    try:
        assert (await call(local_engine, "/release_memory_occupation", method="GET"))[:2] == (200, None)
        assert (await call(local_engine, "/resume_memory_occupation", method="GET"))[:2] == (200, None)
    finally:
        await call(local_engine, "/continue_generation", {})


async def test_stream_validation_error_is_an_sse_error_chunk(local_engine: str) -> None:
    # http_server.generate_request stream path: 200, data: {"error": {...}}, data: [DONE]
    status, _, text = await call(local_engine, "/generate", {"input_ids": PROMPT, "stream": True,
                                                             "sampling_params": {"temperature": -1}})
    lines = [ln for ln in text.split("\n") if ln]
    assert status == 200 and lines[-1] == "data: [DONE]" and len(lines) == 2
    assert json.loads(lines[0][6:]) == {"error": {"message": "temperature must be a non-negative finite number, got -1.0.",
                                                  "type": "invalid_request_error", "code": 400, "retryable": False}}


async def test_engine_refusal_in_a_stream_is_an_sse_error_chunk(local_engine: str) -> None:
    long = asyncio.create_task(call(local_engine, "/generate", {"input_ids": PROMPT, "rid": "twice",
                                                                "sampling_params": {"max_new_tokens": 3000, **GREEDY}}))
    try:
        await wait_running(local_engine)
        status, _, text = await call(local_engine, "/generate", {"input_ids": PROMPT, "rid": "twice", "stream": True})
        lines = [ln for ln in text.split("\n") if ln]
        assert status == 200 and lines[-1] == "data: [DONE]" and len(lines) == 2
        err = json.loads(lines[0][6:])["error"]
        assert "already in flight" in err["message"]
        assert {k: err[k] for k in ("type", "code", "retryable")} == {"type": "invalid_request_error", "code": 400, "retryable": False}
    finally:
        await call(local_engine, "/abort_request", {"rid": "twice"})
        await long


async def test_repetition_penalty_over_http_changes_a_repeating_greedy_run(local_engine: str) -> None:
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 24, **GREEDY}}
    _, plain, _ = await call(local_engine, "/generate", body)
    _, penal, _ = await call(local_engine, "/generate", {**body, "sampling_params": {**body["sampling_params"], "repetition_penalty": 2.0,
                                                                                     "frequency_penalty": 2.0}})
    ids = penal["output_ids"]
    assert len(set(ids)) > len(set(plain["output_ids"])) or len(set(ids)) == len(ids)


# ---- weight updates wait for the generates in flight --------------------------------------------
async def test_weight_update_waits_for_running_generates(local_engine: str, random_model_dir: Path, tmp_path: Path) -> None:
    """tokenizer_manager: updates take model_update_lock.writer_lock unless paused; generates hold the
    reader lock for their whole life. So a generate never mixes two weight versions."""
    other = payload(make_random_model(tmp_path / "other", seed=1))
    orig = payload(random_model_dir)
    _, info, _ = await call(local_engine, "/model_info", method="GET")
    version = info["weight_version"]
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1500, **GREEDY}}
    _, before, _ = await call(local_engine, "/generate", body)
    try:
        done: dict[str, float] = {}

        async def gen() -> Any:
            out = await call(local_engine, "/generate", {**body, "rid": "mid-update"})
            done["gen"] = time.monotonic()
            return out

        task = asyncio.create_task(gen())
        await wait_running(local_engine)
        status, upd, _ = await call(local_engine, "/update_weights_from_tensor",
                                    {"serialized_named_tensors": [other], "weight_version": "other"})
        done["update"] = time.monotonic()
        _, during, _ = await task
        assert status == 200 and upd == {"success": True, "message": "Success Weight version updated to other."}
        assert done["gen"] <= done["update"], "the update did not wait for the generate in flight"
        assert during["output_ids"] == before["output_ids"] and during["meta_info"]["weight_version"] == version
        _, after, _ = await call(local_engine, "/generate", body)
        assert after["output_ids"] != before["output_ids"] and after["meta_info"]["weight_version"] == "other"

        # abort_all_requests: the generate in flight is aborted first, its tokens all from the old weights
        task = asyncio.create_task(call(local_engine, "/generate", {**body, "rid": "aborted-by-update"}))
        await wait_running(local_engine)
        status, upd, _ = await call(local_engine, "/update_weights_from_tensor",
                                    {"serialized_named_tensors": [orig], "abort_all_requests": True})
        _, cut, _ = await task
        assert status == 200 and upd == {"success": True, "message": "Success"}  # no weight_version: SGLang's bare text
        assert cut["meta_info"]["finish_reason"]["type"] == "abort"
        n = len(cut["output_ids"])
        assert 0 < n < 1500 and cut["output_ids"] == after["output_ids"][:n]
    finally:
        await call(local_engine, "/update_weights_from_tensor", {"serialized_named_tensors": [orig], "weight_version": version})


async def test_disk_update_sets_model_path(local_engine: str, random_model_dir: Path, tmp_path: Path) -> None:
    # tokenizer_manager._update_model_path_info after a successful disk update
    other = make_random_model(tmp_path / "disk-other", seed=0)
    _, info, _ = await call(local_engine, "/model_info", method="GET")
    try:
        status, out, _ = await call(local_engine, "/update_weights_from_disk", {"model_path": str(other)})
        assert status == 200 and out == {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        _, now, _ = await call(local_engine, "/model_info", method="GET")
        assert now["model_path"] == str(other) and now["weight_version"] == info["weight_version"]
    finally:
        await call(local_engine, "/update_weights_from_disk", {"model_path": info["model_path"]})
