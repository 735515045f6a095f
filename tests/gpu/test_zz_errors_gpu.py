"""Real SGLang on the GPU: its error responses, and what the client makes of them.

Runs after the other tests on the shared server (file name): request errors SGLang answers with a
4xx (out-of-vocabulary ids are refused by the client, never sent: sglang 0.5.17 does not check them),
then bad weight updates, which the client refuses before sending (GPU run 1 measured sglang 0.5.17
skipping unknown names with `success: true` and its scheduler dying on a wrong shape). Every real status and body is recorded (`RESULTS["tests"][...]["responses"]`) so the CPU
engine and the client's replay fixtures can be checked against them; each test also records whether
the server still serves afterwards.
"""

from __future__ import annotations

import random

import pytest

from gpu_helpers import enabled  # noqa: E402

_ok, _why = enabled()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
import torch  # noqa: E402

import aiohttp  # noqa: E402

from agentloop.engine.base import EngineError, SamplingParams  # noqa: E402
from agentloop.engine.sglang import SGLangClient  # noqa: E402

from gpu_helpers import device, out_dir, record  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.anyio]

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
_r = random.Random(3)
PROMPT = [_r.randrange(3, 320) for _ in range(32)]  # valid ids for every model served here


async def raw(url: str, method: str, path: str, body: object = None, data: bytes | None = None) -> dict:
    """The literal status and body, for the record."""
    async with aiohttp.ClientSession() as s:
        kw = {"data": data, "headers": {"Content-Type": "application/json"}} if data is not None else {"json": body}
        async with s.request(method, url + path, timeout=aiohttp.ClientTimeout(total=120), **kw) as r:
            text = await r.text()
    return {"path": path, "request": body if data is None else data.decode(), "status": r.status, "body": text[:2000]}


async def alive(url: str) -> bool:
    try:
        async with SGLangClient(url, timeout=10, retries=0) as c:
            await c.model_info()
            out = await c.generate(PROMPT, GREEDY)
            return out.finish_type == "length"
    except EngineError:
        return False


@pytest.fixture
async def client(dummy_server):
    if not await alive(dummy_server.url):
        pytest.skip("the shared SGLang server died in an earlier test")
    async with SGLangClient(dummy_server.url, timeout=120, retries=0) as c:
        yield c


async def test_request_errors_are_4xx_with_messages(dummy_server, client) -> None:
    url = dummy_server.url
    before = (await client.generate(PROMPT, GREEDY)).output_ids
    responses = []
    bad_sampling = {"temperature": -1.0, "top_p": 0.0, "top_k": 0, "min_p": 2.0, "max_new_tokens": -1}
    for key, value in bad_sampling.items():
        sp = SamplingParams(max_new_tokens=4).replace(**{key: value})
        with pytest.raises(EngineError) as ei:
            await client.generate(PROMPT, sp)
        assert ei.value.status is not None and 400 <= ei.value.status < 500, ei.value
        assert key in ei.value.message, ei.value.message
        responses.append(await raw(url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {key: value}}))
    # sglang 0.5.17 never checks input ids against the vocabulary: the client does, before sending
    # (sending one is tried on the tool model's server, last: test_out_of_vocab_id_sent_to_real_sglang)
    with pytest.raises(EngineError, match="refused before sending") as ei:
        await client.generate([1, 2, dummy_server.vocab + 5], GREEDY)
    assert ei.value.status is None
    responses.append(await raw(url, "POST", "/generate", data=b'{"input_ids": [1, 2'))
    responses.append(await raw(url, "POST", "/generate", {"sampling_params": {"max_new_tokens": 2}}))
    responses.append(await raw(url, "POST", "/generate", {"input_ids": "not ids", "sampling_params": {}}))
    responses.append(await raw(url, "POST", "/continue_generation", {}))
    responses.append(await raw(url, "POST", "/abort_request", {"rid": "no-such-request"}))
    responses.append(await raw(url, "GET", "/get_weight_version"))
    with pytest.raises(ValueError, match="bogus"):
        await client.release_memory_occupation(["bogus"])  # refused by the client: never sent

    with pytest.raises(EngineError) as ei:
        await client.update_weights_from_disk(str(out_dir() / "no-such-model"))
    assert ei.value.status == 400 and ei.value.message
    responses.append(await raw(url, "POST", "/update_weights_from_disk", {"model_path": str(out_dir() / "no-such-model")}))
    after = (await client.generate(PROMPT, GREEDY)).output_ids
    assert after == before, "a refused request changed the served weights"
    record("test_request_errors_are_4xx_with_messages", responses=responses, server_alive=await alive(url))


async def _greedy_after_flush(c: SGLangClient) -> list[float]:
    assert await c.flush_cache()  # both sides of a comparison without prefix-cache hits (same kernels)
    return (await c.generate(PROMPT, GREEDY)).output_logprobs


async def test_tensor_update_with_unknown_name(dummy_server, client) -> None:
    """The client refuses; sent anyway (check off), sglang 0.5.17 skips the name and says success."""
    bad = [("model.layers.0.self_attn.no_such_proj.weight", torch.zeros(4, 4, dtype=torch.bfloat16, device=device()))]
    with pytest.raises(EngineError, match="refused before sending|does not match") as ei:
        await client.update_weights_from_tensor(bad, weight_version="unknown-name")
    outcome: dict = {"client_refused": ei.value.message}
    before = await _greedy_after_flush(client)
    async with SGLangClient(dummy_server.url, timeout=120, weight_check=False) as unchecked:
        try:
            outcome["sent_anyway"] = await unchecked.update_weights_from_tensor(bad, weight_version="unknown-name")
        except EngineError as e:
            outcome["sent_anyway"] = {"raised": True, "status": e.status, "message": e.message}
    after = await _greedy_after_flush(client)
    outcome["max_logprob_change"] = max(abs(x - y) for x, y in zip(before, after))
    outcome["weight_version_after"] = (await client.model_info())["weight_version"]
    outcome["server_alive"] = await alive(dummy_server.url)
    record("test_tensor_update_with_unknown_name", **outcome)
    assert outcome["server_alive"]


async def test_tensor_update_with_wrong_shape(dummy_server, client) -> None:
    """The client refuses before sending: sglang 0.5.17's scheduler died on this in GPU run 1
    (AssertionError in default_weight_loader, server gone), so it is not sent again."""
    with pytest.raises(EngineError, match="refused before sending|has shape") as ei:
        await client.update_weights_from_tensor(
            [("model.norm.weight", torch.ones(7, dtype=torch.bfloat16, device=device()))], weight_version="bad-shape")
    alive_after = await alive(dummy_server.url)
    record("test_tensor_update_with_wrong_shape", client_refused=ei.value.message, server_alive=alive_after,
           sent_in_run1="scheduler AssertionError: Attempted to load weight (torch.Size([7])) into parameter "
                        "(torch.Size([896])); server died")
    assert alive_after
