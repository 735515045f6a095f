"""Integration tests of the CPU reference engine: `agentloop serve` as a real subprocess on a free
port, driven by the SGLang client (`agentloop.engine.sglang.SGLangClient`) and raw aiohttp.

What they prove: logprobs equal a reference transformers forward pass of the same tokens; greedy
and seeded sampling are reproducible, and equal whether a request runs alone or in a batch;
concurrent requests really share decode steps; stop tokens, EOS and ignore_eos, max_new_tokens;
abort by rid; pause (abort / retract / in_place) and continue; streaming; and two full
release → resume → update → generate cycles with SGLang's memory semantics.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path

import aiohttp
import pytest
import torch

from agentloop.engine.base import EngineError, SamplingParams
from agentloop.engine.sglang import SGLangClient
from agentloop.models.random_model import make_random_model

PROMPT = [1, 87, 85, 268, 201, 74, 75, 223, 20, 13, 21, 2, 201, 1, 67, 270, 294, 201]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ref_model(random_model_dir: Path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(random_model_dir), dtype=torch.float32).eval()


def ref_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """Logprob of each output token under one full forward pass of prompt + output."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lps = torch.log_softmax(logits / temperature, dim=-1)
    return [float(lps[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def ref_greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


async def stats(client: SGLangClient) -> dict:
    return (await client.server_info())["internal_states"][0]


async def wait_running(client: SGLangClient, n: int = 1, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while (await stats(client))["num_running"] < n:
        assert asyncio.get_running_loop().time() < deadline, f"never saw {n} running request(s)"
        await asyncio.sleep(0.01)


async def test_generate_logprobs_match_reference_forward(local_engine: str, ref_model) -> None:
    async with SGLangClient(local_engine) as client:
        greedy = await client.generate(PROMPT, GREEDY)
        assert greedy.finish_reason == {"type": "length", "length": 12}
        assert greedy.output_ids == ref_greedy(ref_model, PROMPT, 12)
        assert greedy.weight_version == "default" and greedy.prompt_tokens == len(PROMPT)
        ref = ref_logprobs(ref_model, PROMPT, greedy.output_ids)
        assert greedy.output_logprobs == pytest.approx(ref, abs=1e-4)

        # Sampled at temperature 0.7: SGLang reports the temperature-scaled, untruncated logprob.
        sp = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, top_k=50, sampling_seed=7, ignore_eos=True)
        sampled = await client.generate(PROMPT, sp)
        ref = ref_logprobs(ref_model, PROMPT, sampled.output_ids, temperature=0.7)
        assert sampled.output_logprobs == pytest.approx(ref, abs=1e-4)


async def test_greedy_and_seeded_sampling_are_reproducible(local_engine: str) -> None:
    async with SGLangClient(local_engine) as client:
        a = await client.generate(PROMPT, GREEDY)
        b = await client.generate(PROMPT, GREEDY)
        assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs

        sp = SamplingParams(max_new_tokens=16, temperature=1.0, sampling_seed=1234, ignore_eos=True)
        s1 = await client.generate(PROMPT, sp)
        s2 = await client.generate(PROMPT, sp)
        assert s1.output_ids == s2.output_ids
        others = [await client.generate(PROMPT, sp.replace(sampling_seed=seed)) for seed in (1, 2, 3)]
        assert any(o.output_ids != s1.output_ids for o in others), "different seeds should sample differently"


async def test_concurrent_requests_share_decode_steps(local_engine: str) -> None:
    async with SGLangClient(local_engine) as client:
        alone = await client.generate(PROMPT, GREEDY.replace(max_new_tokens=24))
        seeded = SamplingParams(max_new_tokens=24, temperature=1.0, sampling_seed=99, ignore_eos=True)
        seeded_alone = await client.generate(PROMPT[:7], seeded)
        before = await stats(client)
        prompts = [PROMPT] + [PROMPT[: 4 + i] for i in range(7)]
        # Held by an in-place pause until all nine are in, so they share decode steps however slowly
        # a loaded machine sends them (without it, each could finish before the next one arrived).
        await client.pause_generation("in_place")

        async def release_when_held() -> None:
            deadline = asyncio.get_running_loop().time() + 30
            while (await stats(client))["num_held"] < len(prompts) + 1:
                assert asyncio.get_running_loop().time() < deadline, "the requests never all arrived"
                await asyncio.sleep(0.01)
            await client.continue_generation()

        *outs, _ = await asyncio.gather(
            *(client.generate(p, GREEDY.replace(max_new_tokens=24)) for p in prompts),
            client.generate(PROMPT[:7], seeded),
            release_when_held(),
        )
        after = await stats(client)
    assert after["max_batch_size_seen"] >= 4, after
    steps = after["decode_steps"] - before["decode_steps"]
    rows = after["decode_rows"] - before["decode_rows"]
    assert rows / steps > 2.0, f"mean decode batch {rows / steps:.2f}: requests were not batched"
    # Batching changes nothing: the same request gives the same tokens alone or in a batch.
    assert outs[0].output_ids == alone.output_ids
    assert outs[0].output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-4)
    assert outs[-1].output_ids == seeded_alone.output_ids


async def test_stop_token_ids_and_max_new_tokens(local_engine: str, ref_model) -> None:
    expected = ref_greedy(ref_model, PROMPT, 12)
    stop = expected[5]
    eos = ref_model.config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    first = next(i for i, t in enumerate(expected) if t == stop or t in eos)
    async with SGLangClient(local_engine) as client:
        out = await client.generate(PROMPT, GREEDY.replace(ignore_eos=False, stop_token_ids=[stop]))
        # Like SGLang with --skip-tokenizer-init: the matched stop token stays, with its logprob.
        assert out.finish_reason == {"type": "stop", "matched": expected[first]}
        assert out.output_ids == expected[: first + 1]
        # Like sglang 0.5.17: ignore_eos disables stop_token_ids too.
        free = await client.generate(PROMPT, GREEDY.replace(stop_token_ids=[stop]))
        assert free.output_ids == expected and free.finish_type == "length"
        assert len(out.output_logprobs) == len(out.output_ids)
        short = await client.generate(PROMPT, GREEDY.replace(max_new_tokens=3))
        assert short.output_ids == expected[:3] and short.finish_reason == {"type": "length", "length": 3}


async def test_eos_stops_unless_ignore_eos(start_local_engine, random_model_dir: Path, ref_model, tmp_path: Path) -> None:
    # A copy of the model whose generation_config names the greedy 3rd token as EOS.
    expected = ref_greedy(ref_model, PROMPT, 8)
    eos = expected[2]
    model_dir = tmp_path / "eos-model"
    shutil.copytree(random_model_dir, model_dir)
    gen_cfg = json.loads((model_dir / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [eos]
    (model_dir / "generation_config.json").write_text(json.dumps(gen_cfg))
    url = start_local_engine(model_dir)
    async with SGLangClient(url) as client:
        stopped = await client.generate(PROMPT, GREEDY.replace(ignore_eos=False, max_new_tokens=8))
        assert stopped.finish_reason == {"type": "stop", "matched": eos}
        assert stopped.output_ids == expected[: expected.index(eos) + 1]
        full = await client.generate(PROMPT, GREEDY.replace(ignore_eos=True, max_new_tokens=8))
        assert full.output_ids == expected and full.finish_type == "length"
        # min_new_tokens keeps EOS from being sampled early (the token is masked before sampling).
        late = await client.generate(PROMPT, GREEDY.replace(ignore_eos=False, max_new_tokens=8, extra={"min_new_tokens": 4}))
        assert eos not in late.output_ids[:4]


async def test_abort_by_rid_returns_partial_tokens(local_engine: str) -> None:
    async with SGLangClient(local_engine) as client:
        long = SamplingParams(max_new_tokens=3000, temperature=1.0, ignore_eos=True)
        task = asyncio.create_task(client.generate(PROMPT, long, rid="abort-me"))
        try:
            await wait_running(client)
            await asyncio.sleep(0.05)
            await client.abort_request("abort-me")
            out = await asyncio.wait_for(task, 10)
        finally:
            task.cancel()
        assert out.aborted and out.finish_reason["message"]
        assert out.rid == "abort-me"
        assert 0 < len(out.output_ids) < 3000 and len(out.output_logprobs) == len(out.output_ids)
        # abort_all, and an unknown rid, are fine too (SGLang answers 200).
        await client.abort_request(abort_all=True)
        await client.abort_request("no-such-rid")
        assert (await stats(client))["num_running"] == 0


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_keeps_requests_and_continue_finishes_them(local_engine: str, mode: str) -> None:
    params = GREEDY.replace(max_new_tokens=400)
    async with SGLangClient(local_engine) as client:
        reference = await client.generate(PROMPT, params)
        task = asyncio.create_task(client.generate(PROMPT, params))
        try:
            await wait_running(client)
            await client.pause_generation(mode)
            frozen = (await stats(client))["generated_tokens"]
            await asyncio.sleep(0.3)
            assert (await stats(client))["generated_tokens"] == frozen, "engine decoded while paused"
            assert not task.done()
            await client.continue_generation()
            out = await asyncio.wait_for(task, 30)
        finally:
            task.cancel()
        assert out.output_ids == reference.output_ids
        assert out.output_logprobs == pytest.approx(reference.output_logprobs, abs=1e-4)
        assert out.raw_meta["num_retractions"] == (1 if mode == "retract" else 0)


async def test_pause_abort_then_new_requests_wait_for_continue(local_engine: str) -> None:
    async with SGLangClient(local_engine) as client:
        task = asyncio.create_task(client.generate(PROMPT, GREEDY.replace(max_new_tokens=3000)))
        try:
            await wait_running(client)
            await client.pause_generation("abort")
            aborted = await asyncio.wait_for(task, 10)
        finally:
            task.cancel()
        assert aborted.aborted
        waiting = asyncio.create_task(client.generate(PROMPT, GREEDY))
        try:
            await asyncio.sleep(0.3)
            assert not waiting.done(), "a request ran while generation was paused"
            assert await client.flush_cache()  # held requests do not make the scheduler busy
            await client.continue_generation()
            out = await asyncio.wait_for(waiting, 10)
        finally:
            waiting.cancel()
        assert out.finish_type == "length" and len(out.output_ids) == GREEDY.max_new_tokens


async def test_flush_cache_refused_while_requests_run(local_engine: str) -> None:
    async with SGLangClient(local_engine) as client:
        task = asyncio.create_task(client.generate(PROMPT, GREEDY.replace(max_new_tokens=3000), rid="busy"))
        try:
            await wait_running(client)
            assert await client.flush_cache() is False
            await client.abort_request("busy")
            await asyncio.wait_for(task, 10)
        finally:
            task.cancel()
        assert await client.flush_cache() is True


async def test_stream_chunks_are_cumulative(local_engine: str) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "stream": True}
    chunks = []
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{local_engine}/generate", json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    chunks.append(line[len("data: "):])
    assert chunks[-1] == "[DONE]"
    data = [json.loads(c) for c in chunks[:-1]]
    ids = [d["output_ids"] for d in data]
    assert all(ids[i] == ids[i + 1][: len(ids[i])] for i in range(len(ids) - 1))
    assert len(ids[-1]) == 5 and data[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert [lp[1] for lp in data[-1]["meta_info"]["output_token_logprobs"]] == ids[-1]
    assert all(d["meta_info"]["finish_reason"] is None for d in data[:-1])


async def test_batch_input_and_prompt_logprobs(local_engine: str, ref_model) -> None:
    body = {"input_ids": [PROMPT, PROMPT[:5]], "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{local_engine}/generate", json=body) as r:
            assert r.status == 200
            out = await r.json()
    assert isinstance(out, list) and len(out) == 2
    meta = out[0]["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, PROMPT[0], None]
    with torch.no_grad():
        lps = torch.log_softmax(ref_model(torch.tensor([PROMPT])).logits[0], dim=-1)
    ref = [float(lps[j - 1, PROMPT[j]]) for j in range(1, len(PROMPT))]
    assert [x[0] for x in meta["input_token_logprobs"][1:]] == pytest.approx(ref, abs=1e-4)
    top = meta["output_top_logprobs"][0]
    assert len(top) == 2 and top[0][1] == out[0]["output_ids"][0] and top[0][0] >= top[1][0]
    assert out[1]["meta_info"]["prompt_tokens"] == 5


async def _weights_bytes(client: SGLangClient) -> int:
    return (await stats(client))["weights_bytes"]


async def test_two_release_resume_update_cycles(local_engine: str, random_model_dir: Path, ref_model, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    other_dir = make_random_model(tmp_path / "other", seed=1)
    other = AutoModelForCausalLM.from_pretrained(str(other_dir), dtype=torch.float32).eval()
    expect_other = ref_greedy(other, PROMPT, 12)
    expect_orig = ref_greedy(ref_model, PROMPT, 12)
    assert expect_other != expect_orig
    all_tags = ["kv_cache", "weights", "cuda_graph"]

    async with SGLangClient(local_engine) as client:
        full_bytes = await _weights_bytes(client)
        for step in (1, 2):
            await client.pause_generation("abort")
            assert await client.flush_cache()
            await client.release_memory_occupation(all_tags)
            assert await _weights_bytes(client) == 0, "released weights still hold storage"
            assert not await client.health()
            with pytest.raises(EngineError) as refused:
                await client.generate(PROMPT, GREEDY)
            assert refused.value.status == 503 and "memory released" in refused.value.message
            assert (await client.model_info())["model_path"]  # non-generating calls still answer

            await client.resume_memory_occupation(["weights"])
            assert await _weights_bytes(client) == full_bytes
            with pytest.raises(EngineError) as still:
                await client.resume_memory_occupation(["weights"])  # not released any more (SGLang: error)
            assert still.value.status == 400
            await client.continue_generation()
            with pytest.raises(EngineError) as kv_refused:
                await client.generate(PROMPT, GREEDY)  # kv_cache is still released
            assert kv_refused.value.status == 503 and "kv_cache" in kv_refused.value.message

            if step == 1:
                # Resumed weights hold zeros until updated: every logit is 0, greedy picks token 0.
                await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
                zero = await client.generate(PROMPT, GREEDY.replace(max_new_tokens=4))
                assert zero.output_ids == [0, 0, 0, 0]
                assert zero.output_logprobs == pytest.approx([-math.log(ref_model.config.vocab_size)] * 4, abs=1e-5)
                named = [(n, p.detach().clone()) for n, p in other.named_parameters()]
                res = await client.update_weights_from_tensor(named, weight_version="step-1")
                assert res["success"] and "step-1" in res["message"]
                expect, version = expect_other, "step-1"
            else:
                # The staged order the lifecycle uses: weights → update → kv_cache + cuda_graph.
                res = await client.update_weights_from_disk(str(random_model_dir), weight_version="step-2")
                assert res["success"]
                await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
                expect, version = expect_orig, "step-2"

            assert await client.health()
            out = await client.generate(PROMPT, GREEDY)
            assert out.output_ids == expect and out.weight_version == version
            assert (await client.model_info())["weight_version"] == version


async def test_max_new_tokens_zero_scores_the_prompt(local_engine: str, ref_model) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 3}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{local_engine}/generate", json=body) as r:
            assert r.status == 200
            out = await r.json()
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    with torch.no_grad():
        lps = torch.log_softmax(ref_model(torch.tensor([PROMPT])).logits[0], dim=-1)
    got = out["meta_info"]["input_token_logprobs"]
    assert [x[1] for x in got] == PROMPT[3:]
    assert [x[0] for x in got] == pytest.approx([float(lps[j - 1, PROMPT[j]]) for j in range(3, len(PROMPT))], abs=1e-4)


async def test_max_running_requests_queues_the_rest(start_local_engine, random_model_dir: Path) -> None:
    url = start_local_engine(random_model_dir, ["--max-running-requests", "2", "--weight-version", "v0"])
    async with SGLangClient(url) as client:
        outs = await asyncio.gather(*(client.generate(PROMPT[: 5 + i], GREEDY) for i in range(5)))
        assert all(len(o.output_ids) == GREEDY.max_new_tokens and o.weight_version == "v0" for o in outs)
        s = await stats(client)
        assert s["max_batch_size_seen"] == 2 and s["num_waiting"] == 0

        # A weight update with abort_all_requests ends in-flight requests first (SGLang's flag).
        task = asyncio.create_task(client.generate(PROMPT, GREEDY.replace(max_new_tokens=3000)))
        try:
            await wait_running(client)
            res = await client.update_weights_from_disk(str(random_model_dir), weight_version="v1", abort_all_requests=True)
            out = await asyncio.wait_for(task, 10)
        finally:
            task.cancel()
        assert res["success"] and out.aborted
        assert (await client.generate(PROMPT, GREEDY)).weight_version == "v1"
