"""SGLangClient over real HTTP.

Part 1 drives the client against an aiohttp.web server that replays SGLang's *recorded* responses
(`tests/fixtures/sglang_http_samples.json`, captured from sglang 0.5.17 on an H200: status codes,
bodies and field types exactly as the real server sent them) and checks the requests the client
sends have the recorded shapes. SGLang's error bodies were not in that recording; the ones used
here are the literal shapes of `sglang/srt/entrypoints/http_server.py` (`_create_error_response`,
FastAPI validation, weight-update `{"success": false}`, `/flush_cache`'s text).

Part 2 (bottom) runs the client against `agentloop serve` (the CPU engine) as a real subprocess.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any, Callable

import aiohttp
import anyio
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from agentloop.engine.base import EngineClient, EngineError, EngineUnavailable, MisalignedLogprobs, SamplingParams
from agentloop.engine.lifecycle import Lifecycle
from agentloop.engine.router import Router
from agentloop.engine.sglang import SGLangClient, error_message

SAMPLES = json.loads((Path(__file__).parent / "fixtures" / "sglang_http_samples.json").read_text())
#: Raw error responses recorded from sglang 0.5.17 on the GPU (tests/gpu/test_zz_errors_gpu.py, run 1).
ERRORS = json.loads((Path(__file__).parent / "fixtures" / "sglang_error_samples.json").read_text())["responses"]


def recorded(label: str) -> dict[str, Any]:
    for c in SAMPLES["calls"]:
        if c.get("label") == label:
            return copy.deepcopy(c)
    raise KeyError(label)


def untrimmed_generate(resp: dict[str, Any]) -> dict[str, Any]:
    """The recording cut long lists with a "..." marker; keep the real prefix consistent.

    Keeps every meta_info field and value as recorded; output_ids are cut to the items whose
    logprob entries were kept, so ids and logprobs still agree as on the real server.
    """
    resp = copy.deepcopy(resp)
    ids = [t for t in resp["output_ids"] if t != "..."]
    meta = resp["meta_info"]
    lps = [x for x in meta.get("output_token_logprobs", []) if x != "..."]
    if lps:
        ids = ids[: len(lps)]
        meta["output_token_logprobs"] = lps
        meta["output_token_logprobs_length"] = len(lps)
    meta.pop("input_token_logprobs", None)
    resp["output_ids"] = ids
    meta["completion_tokens"] = len(ids)
    return resp


class Replay:
    """An aiohttp.web app answering with recorded SGLang responses; logs every request it gets."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.routes: dict[tuple[str, str], Callable[[Any], web.StreamResponse]] = {}

    def on(self, method: str, path: str, fn: Callable[[Any], web.StreamResponse]) -> None:
        self.routes[(method, path)] = fn

    def on_recorded(self, label: str, *, body: Any = None) -> None:
        rec = recorded(label)
        method = rec.get("method", "POST")
        status = rec["status"]
        if body is None:
            if "response" in rec:
                body = json.dumps(rec["response"])
            else:
                body = rec.get("response_text", "")
        ctype = "application/json" if "response" in rec else "text/plain"
        self.on(method, rec["path"], lambda _req: web.Response(status=status, text=body, content_type=ctype))

    def count(self, path: str) -> int:
        return sum(1 for _, p, _ in self.requests if p == path)

    def bodies(self, path: str) -> list[Any]:
        return [b for _, p, b in self.requests if p == path]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.requests.append((request.method, request.path, body))
        fn = self.routes.get((request.method, request.path))
        if fn is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        out = fn(body)
        if hasattr(out, "__await__"):
            out = await out
        return out

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


@pytest.fixture
async def replay():
    r = Replay()
    server = TestServer(r.app(), host="127.0.0.1")
    await server.start_server()
    r.url = str(server.make_url("")).rstrip("/")  # type: ignore[attr-defined]
    try:
        yield r
    finally:
        await server.close()


@pytest.fixture
async def client(replay):
    c = SGLangClient(replay.url, timeout=5, retries=2, backoff=0.01)
    try:
        yield c
    finally:
        await c.close()


# ------------------------------------------------------------------ protocol conformance
def test_implements_engine_protocol() -> None:
    assert isinstance(SGLangClient("http://127.0.0.1:1"), EngineClient)


async def test_generate_parses_recorded_response_and_sends_recorded_shape(replay, client) -> None:
    rec = recorded("generate single, logprobs")
    resp = untrimmed_generate(rec["response"])
    replay.on("POST", "/generate", lambda _b: web.json_response(resp))
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    out = await client.generate(list(range(5, 25)), sp, rid="r-1")

    assert out.output_ids == resp["output_ids"] and len(out.output_ids) == 3
    assert out.output_logprobs == [x[0] for x in resp["meta_info"]["output_token_logprobs"]]
    assert out.finish_reason == {"type": "length", "length": 16}
    assert out.weight_version == "default"
    assert out.rid == resp["meta_info"]["id"]
    assert out.prompt_tokens == 128 and out.server_url == replay.url
    (body,) = replay.bodies("/generate")
    # every field the real request had, with the same types, plus the rid
    for key, value in rec["request"].items():
        if key != "input_ids":
            assert key in body and type(body[key]) is type(value), key
    assert body["input_ids"] == list(range(5, 25)) and body["rid"] == "r-1"
    assert body["sampling_params"]["max_new_tokens"] == 16 and body["sampling_params"]["ignore_eos"] is True
    assert body["sampling_params"]["temperature"] == 0.0


async def test_generate_sends_ids_of_any_int_sequence_as_plain_ints(replay, client) -> None:
    import numpy as np

    resp = untrimmed_generate(recorded("generate single, logprobs")["response"])
    replay.on("POST", "/generate", lambda _b: web.json_response(resp))
    sp = SamplingParams(max_new_tokens=4)
    for ids in ([5, 6, 7], (5, 6, 7), np.array([5, 6, 7]), [np.int64(5), 6, True], [5.0, 6, 7]):
        await client.generate(ids, sp)
    sent = [b["input_ids"] for b in replay.bodies("/generate")]
    assert sent == [[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 1], [5, 6, 7]]  # int() of each, as ever
    assert all(type(t) is int for ids in sent for t in ids)  # 5.0 == 5: the type says it was sent as an int
    async with SGLangClient(replay.url, vocab_size=320) as c:
        with pytest.raises(EngineError, match=r"input_ids\[1\]=320"):
            await c.generate(np.array([1, 320]), sp)
        with pytest.raises(EngineError, match=r"input_ids\[0\]=-2"):
            await c.generate([-2, 1], sp)


async def test_generate_without_rid_sends_a_fresh_one(replay, client) -> None:
    resp = untrimmed_generate(recorded("generate single, logprobs")["response"])
    replay.on("POST", "/generate", lambda _b: web.json_response(resp))
    await client.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
    await client.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
    rids = [b["rid"] for b in replay.bodies("/generate")]
    assert len(set(rids)) == 2 and all(len(r) == 32 for r in rids)


async def test_out_of_vocab_ids_refused_before_sending(replay, client, tmp_path) -> None:
    resp = untrimmed_generate(recorded("generate single, logprobs")["response"])
    replay.on("POST", "/generate", lambda _b: web.json_response(resp))
    replay.on("GET", "/server_info", lambda _b: web.json_response({"tensor_transport": "safetensors", "vocab_size": 320}))

    async def first_generates() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(client.generate, [0, 319], SamplingParams(max_new_tokens=3))

    await first_generates()
    with pytest.raises(EngineError, match=r"input_ids\[1\]=320 is out of vocabulary \[0, 320\)") as ei:
        await client.generate([5, 320, 6], SamplingParams(max_new_tokens=3), rid="oov")
    assert ei.value.endpoint == "/generate" and "oov" in ei.value.message
    with pytest.raises(EngineError, match=r"input_ids\[0\]=-1"):
        await client.generate([-1], SamplingParams(max_new_tokens=3))
    assert replay.count("/generate") == 4 and replay.count("/server_info") == 1  # looked up once

    # real SGLang: no vocab_size in /server_info; the served folder's config.json has it
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    replay.on("GET", "/server_info", lambda _b: web.json_response({"tp_size": 1}))
    replay.on("GET", "/model_info", lambda _b: web.json_response({"model_path": str(tmp_path)}))
    async with SGLangClient(replay.url) as c:
        with pytest.raises(EngineError, match="out of vocabulary"):
            await c.generate([1000], SamplingParams(max_new_tokens=1))
        assert c.served.vocab_size == 1000
    replay.on("GET", "/model_info", lambda _b: web.json_response({"model_path": "/elsewhere/on/a/remote/host"}))
    async with SGLangClient(replay.url) as c:
        await c.generate([10**6], SamplingParams(max_new_tokens=1))  # unknowable: unchecked, sent
        assert c.served.vocab_size is None
    async with SGLangClient(replay.url, vocab_size=None) as c:
        await c.generate([10**6], SamplingParams(max_new_tokens=1))


async def test_recorded_abort_response_is_a_partial_aborted_output(replay, client) -> None:
    resp = recorded("generate long (to be aborted)")["response"]
    resp["output_ids"] = [t for t in resp["output_ids"] if t != "..."]
    replay.on("POST", "/generate", lambda _b: web.json_response(resp))
    out = await client.generate([1] * 8, SamplingParams(max_new_tokens=20000, ignore_eos=True), rid="abort-me",
                                return_logprob=False)
    assert out.aborted and out.finish_reason["message"] == "Aborted"
    assert out.output_ids == resp["output_ids"] and out.output_logprobs == []
    assert out.rid == "abort-me"


async def test_generate_logprob_ids_disagreeing_with_output_ids_fail_loudly(replay, client) -> None:
    resp = untrimmed_generate(recorded("generate single, logprobs")["response"])
    resp["output_ids"][0] += 1
    replay.on("POST", "/generate", lambda _b: web.json_response(resp))
    with pytest.raises(EngineError, match="disagree"):
        await client.generate([1], SamplingParams(max_new_tokens=3))


async def test_sglang_retract_off_by_one_is_named_and_the_turn_asked_again(replay, client) -> None:
    # sglang < 0.5.19 answers a request retracted before its first token with every output id but the
    # first token's logprob (each logprob then carries the id after its own). The router drops that
    # answer whole and asks for the turn again; the server stays in rotation.
    good = untrimmed_generate(recorded("generate single, logprobs")["response"])
    bad = copy.deepcopy(good)
    del bad["meta_info"]["output_token_logprobs"][0]
    answers = [bad, good]
    replay.on("POST", "/generate", lambda _b: web.json_response(answers.pop(0)))
    with pytest.raises(MisalignedLogprobs, match="0.5.19") as err:
        await client.generate([1], SamplingParams(max_new_tokens=3), rid="r1")
    assert err.value.retract_off_by_one and "rid r1" in str(err.value)
    answers[:] = [bad, good]
    router = Router(Lifecycle([client], awake=True))
    out = await router.session("t")([1], SamplingParams(max_new_tokens=3))
    lps = good["meta_info"]["output_token_logprobs"]
    assert out.output_ids == good["output_ids"] and out.output_logprobs == [lp[0] for lp in lps]
    assert router.stats.misaligned_answers == 1 and router.stats.retries == 0 and router.urls == [replay.url]
    assert len([r for r in replay.requests if r[1] == "/generate"]) == 3 and not answers


async def test_answers_that_stay_misaligned_fail_the_turn_after_the_retries(replay, client) -> None:
    bad = untrimmed_generate(recorded("generate single, logprobs")["response"])
    bad["meta_info"]["output_token_logprobs"][0][1] += 1  # logprobs for another id: not the known shape
    replay.on("POST", "/generate", lambda _b: web.json_response(bad))
    router = Router(Lifecycle([client], awake=True), max_retries=2)
    with pytest.raises(MisalignedLogprobs, match="disagree") as err:
        await router.session("t")([1], SamplingParams(max_new_tokens=3))
    assert not err.value.retract_off_by_one
    assert router.stats.misaligned_answers == 2 and router.urls == [replay.url]
    assert len([r for r in replay.requests if r[1] == "/generate"]) == 3


async def test_release_resume_answer_null_and_send_tags(replay, client) -> None:
    replay.on_recorded("step1 release_memory_occupation")
    replay.on_recorded("step1 resume weights")
    assert await client.release_memory_occupation(["kv_cache", "weights", "cuda_graph"]) is None
    assert await client.resume_memory_occupation(["weights"]) is None
    await client.resume_memory_occupation()  # no tags = all (SGLang's default), sent as {}
    assert replay.bodies("/release_memory_occupation") == [recorded("step1 release_memory_occupation")["request"]]
    assert replay.bodies("/resume_memory_occupation") == [{"tags": ["weights"]}, {}]
    with pytest.raises(ValueError, match=r"unknown memory tags \['kv'\]"):
        await client.release_memory_occupation(["weights", "kv"])
    with pytest.raises(ValueError, match="not the string"):
        await client.resume_memory_occupation("weights")  # type: ignore[arg-type]
    assert replay.count("/release_memory_occupation") == 1  # refused before sending


async def test_release_error_carries_endpoint_status_and_message(replay, client) -> None:
    replay.on("POST", "/resume_memory_occupation",
              lambda _b: web.json_response({"error": {"message": "'kv_cache'"}}, status=400))
    with pytest.raises(EngineError) as ei:
        await client.resume_memory_occupation(["kv_cache"])
    e = ei.value
    assert (e.endpoint, e.status, e.message, e.url) == ("/resume_memory_occupation", 400, "'kv_cache'", replay.url)
    assert not isinstance(e, EngineUnavailable)
    assert replay.count("/resume_memory_occupation") == 1  # a POST that reached the server is never repeated


async def test_flush_cache_true_on_recorded_text_false_while_busy(replay, client) -> None:
    replay.on_recorded("step1 flush_cache")
    assert await client.flush_cache() is True
    replay.on("POST", "/flush_cache", lambda _b: web.Response(status=400, text="Flush cache failed.\n"))
    assert await client.flush_cache() is False
    replay.on("POST", "/flush_cache", lambda _b: web.Response(status=500, text="boom"))
    with pytest.raises(EngineError, match="boom"):
        await client.flush_cache()


async def test_abort_pause_continue_bodies_and_empty_answers(replay, client) -> None:
    replay.on_recorded("abort_request by rid")
    replay.on_recorded("pause_generation mode=abort (aborts in-flight)")
    replay.on_recorded("continue_generation")
    await client.abort_request("abort-me")
    await client.abort_request(abort_all=True)
    await client.pause_generation("abort")
    await client.continue_generation()
    assert replay.bodies("/abort_request") == [{"abort_all": False, "rid": "abort-me"}, {"abort_all": True}]
    assert replay.bodies("/pause_generation") == [recorded("pause_generation mode=abort (aborts in-flight)")["request"]]
    assert replay.bodies("/continue_generation") == [{}]
    with pytest.raises(ValueError):
        await client.abort_request()
    with pytest.raises(ValueError):
        await client.pause_generation("later")  # type: ignore[arg-type]


async def test_model_info_and_health(replay, client) -> None:
    replay.on_recorded("/model_info")
    replay.on_recorded("health (first: runs a 1-token generate)")
    info = await client.model_info()
    assert info["weight_version"] == "default" and info["model_path"] == "/tmp/model"
    assert await client.weight_version() == "default"
    assert await client.health() is True
    replay.on("GET", "/health", lambda _b: web.Response(status=503))
    assert await client.health() is False
    assert replay.count("/health") == 2  # health is not retried: it generates on SGLang


async def test_update_weights_from_tensor_safetensors_transport(replay, client) -> None:
    replay.on("GET", "/server_info", lambda _b: web.json_response({"tensor_transport": "safetensors", "tp_size": 1}))
    replay.on_recorded("step1 update_weights_from_tensor (290 CUDA-IPC tensors, base64)")
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.ones(4, dtype=torch.bfloat16)
    out = await client.update_weights_from_tensor([("layer.weight", w.t()), ("layer.bias", b)],
                                                  weight_version="step-1", flush_cache=True)
    assert out == {"success": True, "message": "Success Weight version updated to step-1."}
    (body,) = replay.bodies("/update_weights_from_tensor")
    rec_req = recorded("step1 update_weights_from_tensor (290 CUDA-IPC tensors, base64)")["request"]
    assert set(rec_req) <= set(body)
    assert body["weight_version"] == "step-1" and body["flush_cache"] is True and body["load_format"] is None
    assert len(body["serialized_named_tensors"]) == 1
    from safetensors.torch import load

    got = load(base64.b64decode(body["serialized_named_tensors"][0]))
    assert torch.equal(got["layer.weight"], w.t()) and got["layer.bias"].dtype == torch.bfloat16
    # transport is asked once
    await client.update_weights_from_tensor({"layer.bias": b})
    assert replay.count("/server_info") == 1


async def test_update_weights_success_false_raises_with_message(replay, client) -> None:
    client.served.tensor_transport = "safetensors"
    replay.on("POST", "/update_weights_from_tensor", lambda _b: web.json_response(
        {"success": False, "message": "Attempted to load weight (torch.Size([3])) into parameter (torch.Size([4]))"},
        status=400))
    with pytest.raises(EngineError) as ei:
        await client.update_weights_from_tensor([("x", torch.zeros(3))])
    assert ei.value.status == 400 and "Attempted to load weight" in ei.value.message
    replay.on("POST", "/update_weights_from_disk", lambda _b: web.json_response(
        {"success": False, "message": "Failed to get weights iterator: no such dir.", "num_paused_requests": 0},
        status=400))
    with pytest.raises(EngineError, match="weights iterator"):
        await client.update_weights_from_disk("/nope", weight_version="v9")
    assert replay.bodies("/update_weights_from_disk")[0] == {
        "model_path": "/nope", "flush_cache": True, "abort_all_requests": False, "weight_version": "v9"}


async def test_real_server_info_selects_sglang_transport(replay, client) -> None:
    keys = recorded("/server_info")["response_keys"]
    info = {k: None for k in keys}
    info["tp_size"] = 2
    replay.on("GET", "/server_info", lambda _b: web.json_response(info))
    assert await client.served.resolve_tensor_transport() == "cuda_ipc"
    assert client.served.tp_size == 2


async def test_tensor_updates_to_sglang_checked_against_the_model_before_sending(replay, client, tmp_path) -> None:
    """Real SGLang skips unknown names with success:true and dies on a wrong shape (GPU run 1)."""
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 100,
           "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    replay.on("GET", "/server_info", lambda _b: web.json_response({"tp_size": 1}))  # no tensor_transport: SGLang
    replay.on("GET", "/model_info", lambda _b: web.json_response({"model_path": str(tmp_path)}))
    with pytest.raises(EngineError, match=r"refused before sending: 1 tensor name.*model.layers.0.self_attn.qq_proj.weight"):
        await client.update_weights_from_tensor([("model.layers.0.self_attn.qq_proj.weight", torch.zeros(32, 32))])
    with pytest.raises(EngineError, match=r"'model.norm.weight' has shape \[7\], the model's parameter has \[32\]"):
        await client.update_weights_from_tensor([("model.norm.weight", torch.zeros(7))])
    assert replay.count("/update_weights_from_tensor") == 0
    # a trainer's full state dict (tied lm_head included) passes
    good = [("model.embed_tokens.weight", torch.zeros(100, 32)), ("lm_head.weight", torch.zeros(100, 32)),
            ("model.layers.0.mlp.gate_proj.weight", torch.zeros(64, 32)), ("model.norm.weight", torch.zeros(32))]
    await client.served.check_named_tensors(good)
    # prepare() looks everything up ahead of the first update: nothing left to ask afterwards
    async with SGLangClient(replay.url) as c:
        await c.prepare()
        assert c.served.tensor_transport == "cuda_ipc" and c.served.tp_size == 1 and c.served.vocab_size == 100
        assert c.served.param_shapes["model.norm.weight"] == (32,)  # type: ignore[index]
        n = len(replay.requests)
        await c.served.check_named_tensors(good)
        assert len(replay.requests) == n
    # formats other than HF names are not checked; a remote server's model is unknown: not checked
    replay.on("GET", "/model_info", lambda _b: web.json_response({"model_path": "/not/on/this/host"}))
    async with SGLangClient(replay.url) as c:
        await c.served.check_named_tensors([("anything", torch.zeros(1))])


async def test_distributed_group_calls(replay, client) -> None:
    ok = {"success": True, "message": "Succeeded"}
    for p in ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"):
        replay.on("POST", p, lambda _b: web.json_response(ok))
    await client.init_weights_update_group("127.0.0.1", 29500, 1, 2, group_name="g")
    await client.update_weights_from_distributed(["a", "b"], [torch.bfloat16, "float32"], [[2, 3], (4,)], group_name="g",
                                                 weight_version="v2")
    await client.destroy_weights_update_group("g")
    assert replay.bodies("/init_weights_update_group") == [
        {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
         "group_name": "g", "backend": "nccl"}]
    b = replay.bodies("/update_weights_from_distributed")[0]
    assert b["dtypes"] == ["bfloat16", "float32"] and b["shapes"] == [[2, 3], [4]] and b["weight_version"] == "v2"


# ------------------------------------------------------------------ errors, retries, timeouts
@pytest.mark.parametrize("body,status,expected", [
    ({"error": {"message": "The input_ids [1, 999999] contains values greater than the vocab size (32)."}}, 400,
     "The input_ids [1, 999999] contains values greater than the vocab size (32)."),
    ({"detail": [{"type": "missing", "loc": ["body", "input_ids"], "msg": "Field required"}]}, 422,
     "input_ids: Field required"),
    ({"detail": "Endpoint '/get_weight_version' or '/weight_version' is deprecated."}, 404,
     "Endpoint '/get_weight_version' or '/weight_version' is deprecated."),
    ("Internal Server Error", 500, "Internal Server Error"),
])
async def test_generate_errors_carry_server_message(replay, client, body, status, expected) -> None:
    await _expect_error(replay, client, body, status, expected)


@pytest.mark.parametrize("rec", [r for r in ERRORS if r["status"] >= 400], ids=lambda r: f"{r['path']}-{r['status']}")
async def test_recorded_real_error_bodies(replay, client, rec) -> None:
    """Every error body real SGLang sent in GPU run 1 gives an EngineError with its message."""
    body = json.loads(rec["body"])
    message = body["error"]["message"] if "error" in body else body["message"]
    await _expect_error(replay, client, body, rec["status"], message)


async def _expect_error(replay, client, body, status, expected) -> None:
    if isinstance(body, str):
        replay.on("POST", "/generate", lambda _b: web.Response(status=status, text=body))
    else:
        replay.on("POST", "/generate", lambda _b: web.json_response(body, status=status))
    with pytest.raises(EngineError) as ei:
        await client.generate([1, 999999], SamplingParams(max_new_tokens=2))
    assert ei.value.status == status and ei.value.message == expected and ei.value.endpoint == "/generate"
    assert replay.url in str(ei.value) and str(status) in str(ei.value)
    assert replay.count("/generate") == 1


def test_error_message_shapes() -> None:
    assert error_message(b"") == "(empty response body)"
    assert error_message(b'{"error": ["a", "b"]}') == "a; b"
    assert error_message(b'{"success": false, "message": "nope"}') == "nope"


async def test_get_retried_on_503_post_not(replay, client) -> None:
    hits = {"n": 0}

    def flaky(_b: Any) -> web.Response:
        hits["n"] += 1
        if hits["n"] < 3:
            return web.Response(status=503, text="starting")
        return web.json_response({"weight_version": "default", "model_path": "/m"})

    replay.on("GET", "/model_info", flaky)
    assert (await client.model_info())["model_path"] == "/m"
    assert replay.count("/model_info") == 3
    replay.on("POST", "/generate", lambda _b: web.Response(status=503, text="starting"))
    with pytest.raises(EngineError) as ei:
        await client.generate([1], SamplingParams(max_new_tokens=1))
    assert ei.value.status == 503 and replay.count("/generate") == 1


async def test_dropped_connection_after_send_not_retried_for_post(replay, client) -> None:
    async def drop_handler(request: web.Request) -> web.StreamResponse:
        replay.requests.append((request.method, request.path, await request.read()))
        request.transport.close()  # type: ignore[union-attr]
        await anyio.sleep(0.1)
        return web.Response()

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", drop_handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with SGLangClient(str(server.make_url("")).rstrip("/"), timeout=5, retries=2, backoff=0.01) as c:
            with pytest.raises(EngineUnavailable):
                await c.generate([1], SamplingParams(max_new_tokens=1))
            assert sum(1 for _, p, _ in replay.requests if p == "/generate") == 1
            with pytest.raises(EngineUnavailable):
                await c.model_info()
            # GET: 1 + 2 retries (aiohttp itself may repeat an idempotent request once per attempt)
            assert sum(1 for _, p, _ in replay.requests if p == "/model_info") >= 3
    finally:
        await server.close()


async def test_connection_refused_is_unavailable_after_retries() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with SGLangClient(f"http://127.0.0.1:{port}", timeout=2, retries=2, backoff=0.01) as c:
        with pytest.raises(EngineUnavailable, match="cannot connect") as ei:
            await c.release_memory_occupation(["weights"])  # nothing sent: even a POST may be retried
        assert ei.value.endpoint == "/release_memory_occupation" and ei.value.status is None


async def test_every_call_times_out(replay) -> None:
    async def slow(_b: Any) -> web.Response:
        await anyio.sleep(5)
        return web.Response(text="late")

    replay.on("POST", "/generate", slow)
    replay.on("POST", "/flush_cache", slow)
    async with SGLangClient(replay.url, timeout=0.3, generate_timeout=0.3, retries=0) as c:
        with anyio.fail_after(3):
            with pytest.raises(EngineUnavailable, match="timed out"):
                await c.generate([1], SamplingParams(max_new_tokens=1))
            with pytest.raises(EngineUnavailable, match="timed out"):
                await c.flush_cache()
            with pytest.raises(EngineUnavailable, match="timed out"):
                await c.generate([1], SamplingParams(max_new_tokens=1), timeout=0.2)


async def test_session_is_shared_lazy_and_closed(replay) -> None:
    replay.on_recorded("/model_info")
    c = SGLangClient(replay.url)
    assert c._session is None
    await c.model_info()
    s = c._session
    await c.model_info()
    assert c._session is s
    await c.close()
    assert s is not None and s.closed
    await c.model_info()  # a closed client reopens lazily
    await c.close()
    async with aiohttp.ClientSession() as shared:
        async with SGLangClient(replay.url, session=shared) as c2:
            await c2.model_info()
        assert not shared.closed  # a session given in is the caller's to close


async def test_generations_outside_awake_counts_what_leaves_the_client_after_the_gate_closed() -> None:
    """The metric is measured where the request leaves the client, not where the gate was passed: a
    generate that passed the gate but whose vocabulary lookup (/server_info) was still running when a
    sleep began is sent outside AWAKE, and counted; generates sent while AWAKE are not."""
    from agentloop.engine.lifecycle import Lifecycle

    info_started = anyio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        if request.path == "/server_info":  # the vocabulary lookup of a client's first generate
            info_started.set()
            await anyio.sleep(0.5)
            return web.json_response({"vocab_size": 100, "tensor_transport": "safetensors"})
        if request.path == "/generate":
            return web.json_response({"output_ids": [1], "meta_info": {
                "id": "r", "finish_reason": {"type": "length", "length": 1}, "output_token_logprobs": [[-0.1, 1, None]]}})
        if request.path == "/flush_cache":
            return web.Response(text="Cache flushed.")
        if request.path == "/model_info":  # the lifecycle's liveness probe
            return web.json_response({"model_path": "/m", "weight_version": "default"})
        if request.path == "/update_weight_version":  # the lifecycle's memory marks
            return web.json_response({"success": True, "message": "ok"})
        return web.json_response({"message": "ok", "status": "ok"} if "generation" in request.path else None)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        with anyio.fail_after(30):  # hang guard
            async with SGLangClient(url, retries=0, vocab_size=None) as awake_only:
                lc = Lifecycle([awake_only])
                assert awake_only.gate_open is not None and awake_only.gate_open()
                await lc.generate(url, [1, 2], SamplingParams(max_new_tokens=1))  # AWAKE: not counted
                assert lc.generations_outside_awake == 0
            async with SGLangClient(url, retries=0) as client:
                lc = Lifecycle([client])
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: lc.generate(url, [1, 2], SamplingParams(max_new_tokens=1)))
                    await info_started.wait()  # past the gate, not yet sent
                    await lc.sleep()  # waits for the in-flight generate, which now leaves outside AWAKE
                assert client.sent_outside_awake == 1 and lc.generations_outside_awake == 1
    finally:
        await server.close()
