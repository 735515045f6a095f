"""Real SGLang on the GPU: aborts mid-step, sleep with requests in flight, the gate while asleep.

- abort by rid and abort_all while requests decode: they come back 200 with finish_reason
  `abort`, their partial tokens and matching logprobs; other requests are untouched.
- `Lifecycle.sleep()` while 8 long requests decode: pause(abort) ends them, sleep completes, and
  every released tag is resumed at the next wake-up.
- while asleep, a generate waits at the gate and a health probe uses `/model_info`: neither a
  `/generate` nor a `/health` is sent (the client is instrumented to prove it); after wake-up the
  held generate runs. The server is alive at the end (a generate reaching it released kills it).
"""

from __future__ import annotations

import random

import pytest

from gpu_helpers import enabled  # noqa: E402

_ok, _why = enabled()
if not _ok:
    pytest.skip(_why, allow_module_level=True)

import anyio  # noqa: E402

from agentloop.engine.base import GenerateOutput, SamplingParams  # noqa: E402
from agentloop.engine.lifecycle import EngineState, Lifecycle, Weights  # noqa: E402
from agentloop.engine.launch import QWEN2_05B_CONFIG  # noqa: E402
from agentloop.engine.sglang import SGLangClient  # noqa: E402

from gpu_helpers import InstrumentedClient, gpu_memory, record  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.anyio]

LONG = SamplingParams(max_new_tokens=8000, temperature=1.0, ignore_eos=True)


VOCAB = 320  # the smallest vocabulary served here (dry run); ids below it are valid for every model


def prompt(seed: int, n: int = 64) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, VOCAB) for _ in range(n)]


def check_partial(out: GenerateOutput) -> None:
    assert out.aborted, out.finish_reason
    assert 0 < len(out.output_ids) < LONG.max_new_tokens
    assert len(out.output_logprobs) == len(out.output_ids)


async def _lifecycle(server) -> tuple[Lifecycle, InstrumentedClient]:
    client = InstrumentedClient(SGLangClient(server.url, timeout=120))
    lc = Lifecycle([client], awake=True)
    client.lifecycle = lc
    return lc, client


async def _finish(lc: Lifecycle, client: InstrumentedClient, server) -> None:
    if lc.state is not EngineState.AWAKE:
        await lc.wake_up(Weights(state_dict=server.weights_a, version="recovered"))
    await client.close()


async def test_abort_by_rid_and_abort_all_mid_step(dummy_server) -> None:
    lc, client = await _lifecycle(dummy_server)
    url = dummy_server.url
    outs: dict[str, GenerateOutput] = {}
    try:
        async def gen(rid: str, sp: SamplingParams = LONG) -> None:
            outs[rid] = await lc.generate(url, prompt(sum(map(ord, rid))), sp, rid=rid)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(gen, "victim")
                tg.start_soon(gen, "bystander", SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True))
                await anyio.sleep(1.5)
                await lc.abort("victim")
        check_partial(outs["victim"])
        assert outs["bystander"].finish_type == "length" and len(outs["bystander"].output_ids) == 64

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(gen, f"all-{i}")
                await anyio.sleep(1.5)
                await lc.abort(abort_all=True)
        for i in range(6):
            check_partial(outs[f"all-{i}"])
        # the server keeps serving
        after = await lc.generate(url, prompt(5), SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        assert after.finish_type == "length"
        record("test_abort_by_rid_and_abort_all_mid_step",
               victim_tokens_before_abort=len(outs["victim"].output_ids),
               victim_finish_reason=outs["victim"].finish_reason,
               abort_all_tokens=[len(outs[f"all-{i}"].output_ids) for i in range(6)])
    finally:
        await _finish(lc, client, dummy_server)


async def test_sleep_with_requests_in_flight_then_gate_holds_generate_and_health(dummy_server) -> None:
    lc, client = await _lifecycle(dummy_server)
    url = dummy_server.url
    outs: list[GenerateOutput] = []
    try:
        async def gen(i: int) -> None:
            outs.append(await lc.generate(url, prompt(100 + i), LONG, rid=f"inflight-{i}"))

        with anyio.fail_after(180):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(gen, i)
                await anyio.sleep(1.5)
                assert lc.in_flight(url) == 8
                await lc.sleep()
        assert lc.state is EngineState.SLEEPING and len(outs) == 8
        for o in outs:
            check_partial(o)
        asleep = gpu_memory()
        sent_before = dict(client.sent)

        # asleep: health goes to /model_info, a generate waits at the gate
        assert await lc.health(url) is True
        held: list[GenerateOutput] = []

        async def held_gen() -> None:
            held.append(await lc.generate(url, prompt(7), SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)))

        with anyio.fail_after(180):
            async with anyio.create_task_group() as tg:
                tg.start_soon(held_gen)
                await anyio.sleep(2.0)
                assert held == [] and client.sent == sent_before, "a generate/health went out while asleep"
                with pytest.raises(TimeoutError):
                    await lc.generate(url, prompt(8), SamplingParams(max_new_tokens=4), gate_timeout=0.5)
                assert client.sent == sent_before
                await lc.wake_up(Weights(state_dict=dummy_server.weights_a, version="after-inflight-sleep"))
        assert len(held) == 1 and held[0].weight_version == "after-inflight-sleep"
        assert client.sent_outside_awake == []
        assert (await client.model_info())["weight_version"] == "after-inflight-sleep"
        assert await lc.health(url) is True  # now AWAKE: a real /health
        record("test_sleep_with_requests_in_flight_then_gate_holds_generate_and_health",
               inflight_tokens_at_sleep=[len(o.output_ids) for o in outs], memory_asleep=asleep,
               sleep_stages=[{"stage": r.stage, "seconds": round(r.seconds, 4)} for r in lc.records if r.phase == "sleep"],
               sent_while_asleep=0, generations_outside_awake=lc.generations_outside_awake)
    finally:
        await _finish(lc, client, dummy_server)


async def test_stop_token_ids_keep_the_matched_token_dummy(dummy_server) -> None:
    """With --skip-tokenizer-init, is a matched stop token the last of output_ids (the CPU engine's
    contract), with its logprob? Greedy runs after a cache flush each, so both use the same kernels."""
    lc, client = await _lifecycle(dummy_server)
    url = dummy_server.url
    try:
        greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
        assert await client.flush_cache()
        free = await lc.generate(url, prompt(11), greedy)
        stop = free.output_ids[5]
        first = free.output_ids.index(stop)
        assert await client.flush_cache()
        # sglang 0.5.17 checks stop_token_ids only without ignore_eos (GPU run 2); the dummy model's EOS
        # (151643) is not among these ids, so only the stop token can end the run
        assert QWEN2_05B_CONFIG["eos_token_id"] not in free.output_ids[: first + 1]
        out = await lc.generate(url, prompt(11), greedy.replace(stop_token_ids=[stop], ignore_eos=False))
        record("test_stop_token_ids_keep_the_matched_token_dummy", unstopped=free.output_ids, stop_token=stop,
               stopped=out.output_ids, finish_reason=out.finish_reason, stopped_logprobs=out.output_logprobs)
        assert out.finish_reason == {"type": "stop", "matched": stop}, out.finish_reason
        assert out.output_ids == free.output_ids[: first + 1], "the matched stop token is kept as the last id"
        assert len(out.output_logprobs) == len(out.output_ids)
    finally:
        await _finish(lc, client, dummy_server)
