"""Real SGLang on the GPU: `Lifecycle.update_weights_in_flight` (pause with `retract` → load with
flush_cache=false → continue), twice, while 32 greedy requests of 512 tokens run.

Asserted: every request finishes its length (none aborted or lost), every response carries a version
of an update that happened while it ran, nothing leaves a client outside AWAKE, and after the second
update (back to the first weights) a batch-1 greedy probe equals the probe taken before the first update
(the update applied in full). Recorded: each stage's seconds (pause, update_weights, continue), and the
radix-cache question the docstring names: a probe whose prompt the radix tree cached under the old
weights, re-sent right after an update (may reuse prefix KV the old weights wrote; no flush can run
while retracted requests wait), against the same probe once nothing is queued and the cache flushed.
"""

from __future__ import annotations

import random
import time

import pytest

from gpu_helpers import enabled  # noqa: E402

_ok, _why = enabled()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
import torch  # noqa: E402

import anyio  # noqa: E402

from agentloop.engine.base import SamplingParams  # noqa: E402
from agentloop.engine.lifecycle import EngineState, Lifecycle, Weights  # noqa: E402
from agentloop.engine.sglang import SGLangClient  # noqa: E402

from gpu_helpers import InstrumentedClient, device, record  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.anyio]

N_REQ, LENGTH = 32, 512


def perturbed(weights: dict, seed: int, scale: float = 0.01) -> dict:
    g = torch.Generator(device=device())
    g.manual_seed(seed)
    return {n: (t.float() + torch.randn(t.shape, generator=g, device=device()) * scale).to(t.dtype)
            for n, t in weights.items()}


async def probe(lc: Lifecycle, url: str, prompt: list[int]) -> list[float]:
    o = await lc.generate(url, prompt, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    return o.output_logprobs


def max_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


async def test_weights_updated_in_flight_twice(dummy_server) -> None:
    url = dummy_server.url
    client = InstrumentedClient(SGLangClient(url, timeout=300))
    lc = Lifecycle([client], awake=True, staged=True)
    client.lifecycle = lc
    rng = random.Random(0)
    prompts = [[rng.randrange(3, dummy_server.vocab) for _ in range(128)] for _ in range(N_REQ)]
    probe_prompt = [rng.randrange(3, dummy_server.vocab) for _ in range(64)]
    w_a = dummy_server.weights_a
    w_b = perturbed(w_a, seed=11)
    try:
        await lc.sleep()
        await lc.wake_up(Weights(state_dict=w_a, version="a1"))
        before = await probe(lc, url, probe_prompt)  # also caches probe_prompt's prefix under w_a
        outs: dict[int, object] = {}
        mark = lc.record_mark()
        timings = []

        async def one(i: int) -> None:
            outs[i] = await lc.generate(url, prompts[i], SamplingParams(max_new_tokens=LENGTH, temperature=0.0,
                                                                         ignore_eos=True), rid=f"long-{i}")

        async with anyio.create_task_group() as tg:
            for i in range(N_REQ):
                tg.start_soon(one, i)
            await anyio.sleep(1.0)
            t0 = time.perf_counter()
            assert await lc.update_weights_in_flight(Weights(state_dict=w_b, version="b2")) == "b2"
            timings.append(time.perf_counter() - t0)
            stale_b = await probe(lc, url, probe_prompt)  # right after: requests still retracted/running
            await anyio.sleep(0.5)
            t0 = time.perf_counter()
            assert await lc.update_weights_in_flight(Weights(state_dict=w_a, version="a3")) == "a3"
            timings.append(time.perf_counter() - t0)
        after = await probe(lc, url, probe_prompt)
        finished = {i: (o.finish_type, len(o.output_ids), o.weight_version) for i, o in outs.items()}  # type: ignore[attr-defined]
        assert len(finished) == N_REQ and all(f == "length" and n == LENGTH for f, n, _ in finished.values()), finished
        assert {v for _, _, v in finished.values()} <= {"b2", "a3"}
        assert lc.state is EngineState.AWAKE and lc.generations_outside_awake == 0 and client.sent_outside_awake == []
        stages = lc.records_since(mark)
        assert [r.stage for r in stages] == ["pause", "update_weights", "continue"] * 2
        # back on w_a: the probe equals the one before (its prefix KV is w_a's either way)
        assert max_diff(before, after) <= 1e-3, (before, after)
        # w_b served cleanly, once nothing is queued: flush, then probe under w_b
        await lc.update_weights_in_flight(Weights(state_dict=w_b, version="b4"))
        assert await client.flush_cache()
        clean_b = await probe(lc, url, probe_prompt)
        record("test_weights_updated_in_flight_twice", requests=N_REQ, length=LENGTH,
               update_seconds=[round(t, 4) for t in timings],
               stages=[{"stage": r.stage, "seconds": round(r.seconds, 4)} for r in stages],
               versions_at_finish=sorted({v for _, _, v in finished.values()}),
               probe_w_a_vs_clean_w_b_max_logprob_diff=round(max_diff(before, clean_b), 5),
               probe_right_after_update_vs_clean_w_b_max_logprob_diff=round(max_diff(stale_b, clean_b), 5),
               stale_prefix_kv_suspected=max_diff(stale_b, clean_b) > 1e-2)
    finally:
        if lc.state is not EngineState.AWAKE:
            await lc.sleep()
            await lc.wake_up(Weights(state_dict=w_a, version="after-update-in-flight"))
        else:
            await lc.update_weights_in_flight(Weights(state_dict=w_a, version="after-update-in-flight"))
        await client.close()
