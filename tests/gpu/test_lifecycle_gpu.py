"""Real SGLang on the GPU: the staged lifecycle for 3 steps, through `Lifecycle` and `SGLangClient`.

Each step: wake_up (resume weights → update_weights_from_tensor with the trainer's state dict →
resume kv_cache + cuda_graph) → multi-turn generation of 16 trajectories → sleep (pause/abort →
settle → flush → release all). Step 2 loads a perturbed copy of step 1's weights, step 3 step 1's
again: greedy outputs must change at step 2 and come back at step 3, and `weight_version` must be
the step's in every response and in `/model_info`. GPU memory is read after every memory call.
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

from gpu_helpers import DRYRUN, InstrumentedClient, device, gpu_memory, record  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.anyio]

N_TRAJ, TURNS, TURN_TOKENS = 16, 3, 32


def perturbed(weights: dict, seed: int, scale: float = 0.01) -> dict:
    g = torch.Generator(device=device())
    g.manual_seed(seed)
    return {n: (t.float() + torch.randn(t.shape, generator=g, device=device()) * scale).to(t.dtype)
            for n, t in weights.items()}


async def multi_turn(lc: Lifecycle, url: str, prompt: list[int], rng: random.Random, step: int, i: int, vocab: int) -> dict:
    """One trajectory: model turn, then a 'tool/user' turn of fixed ids appended, TURNS times."""
    ids = list(prompt)
    turns = []
    for t in range(TURNS):
        out = await lc.generate(url, ids, SamplingParams(max_new_tokens=TURN_TOKENS, temperature=1.0, ignore_eos=True),
                                rid=f"s{step}-t{i}-turn{t}")
        assert len(out.output_ids) == len(out.output_logprobs) == TURN_TOKENS
        assert all(lp <= 0.0 for lp in out.output_logprobs)
        turns.append({"weight_version": out.weight_version, "finish": out.finish_type,
                      "cached_tokens": out.cached_tokens, "prompt_tokens": out.prompt_tokens})
        ids += out.output_ids + [rng.randrange(3, vocab) for _ in range(8)]
    return {"turns": turns, "total_tokens": len(ids)}


async def greedy_probe(lc: Lifecycle, url: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Greedy (ids, logprobs), one request at a time (batch size 1: no batch-composition noise)."""
    outs = []
    for p in prompts:
        o = await lc.generate(url, p, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
        outs.append((o.output_ids, o.output_logprobs))
    return outs


def same_outputs(a: list[tuple[list[int], list[float]]], b: list[tuple[list[int], list[float]]], tol: float) -> bool:
    """Same greedy ids and logprobs within `tol` (random weights can make greedy ids repeat a
    prompt token whatever the weights; the logprobs still tell the weights apart)."""
    return all(ia == ib and max((abs(x - y) for x, y in zip(la, lb)), default=0.0) <= tol
               for (ia, la), (ib, lb) in zip(a, b))


async def test_three_step_staged_lifecycle(dummy_server) -> None:
    url = dummy_server.url
    client = InstrumentedClient(SGLangClient(url, timeout=120))
    lc = Lifecycle([client], awake=True, staged=True)
    client.lifecycle = lc
    states_at_dispatch: list[str] = []
    lc.on_generate = lambda _u, s: states_at_dispatch.append(s.value)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, dummy_server.vocab) for _ in range(64)] for _ in range(N_TRAJ)]
    probes = prompts[:4]
    w_a = dummy_server.weights_a
    w_b = perturbed(w_a, seed=7)
    step_weights = {1: w_a, 2: w_b, 3: w_a}
    steps = []
    greedy: dict[int, list[tuple[list[int], list[float]]]] = {}
    try:
        await lc.sleep()  # the server starts awake with its dummy weights: step 0 is the first release
        asleep_mem = gpu_memory()
        for step in (1, 2, 3):
            n_events = len(client.events)
            n_records = len(lc.records)
            t0 = time.perf_counter()
            version = await lc.wake_up(Weights(state_dict=step_weights[step], version=f"step-{step}"))
            wake_s = time.perf_counter() - t0
            assert version == f"step-{step}" and lc.state is EngineState.AWAKE
            assert (await client.model_info())["weight_version"] == f"step-{step}"
            t1 = time.perf_counter()
            greedy[step] = await greedy_probe(lc, url, probes)
            results: list[dict] = [{}] * N_TRAJ

            async def one(i: int) -> None:
                results[i] = await multi_turn(lc, url, prompts[i], random.Random(step * 1000 + i), step, i, dummy_server.vocab)

            async with anyio.create_task_group() as tg:
                for i in range(N_TRAJ):
                    tg.start_soon(one, i)
            gen_s = time.perf_counter() - t1
            versions = {t["weight_version"] for r in results for t in r["turns"]}
            assert versions == {f"step-{step}"}, versions
            t2 = time.perf_counter()
            await lc.sleep()
            sleep_s = time.perf_counter() - t2
            steps.append({
                "step": step, "weight_version": version, "wake_up_seconds": round(wake_s, 4),
                "generation_seconds": round(gen_s, 3), "sleep_seconds": round(sleep_s, 4),
                "trajectories": len(results), "turns_per_trajectory": TURNS,
                "generated_tokens": N_TRAJ * TURNS * TURN_TOKENS + len(probes) * 16,
                "cached_tokens_later_turns": sum(t["cached_tokens"] for r in results for t in r["turns"][1:]),
                "stages": [{"phase": r.phase, "stage": r.stage, "seconds": round(r.seconds, 4)}
                           for r in lc.records[n_records:]],
                "memory_after_each_call": client.events[n_events:],
            })
        # step 2 loaded different weights, step 3 step 1's again
        assert not same_outputs(greedy[1], greedy[2], 1e-3), "outputs did not change after loading perturbed weights"
        assert same_outputs(greedy[1], greedy[3], 1e-4), "same weights, same greedy outputs (batch size 1)"
        assert lc.generations_outside_awake == 0
        assert client.sent_outside_awake == [], client.sent_outside_awake
        assert set(states_at_dispatch) == {"AWAKE"}
        ev = client.events
        freed = [ev[k - 1]["used_gib"] - ev[k]["used_gib"] for k in range(1, len(ev))
                 if ev[k]["call"] == "release_memory_occupation"]
        # every release gives back the KV cache and the weights: GiBs, not MiBs
        assert len(freed) == 4 and (DRYRUN or all(f > 1.0 for f in freed)), freed
        resumed_w = [e for e in ev if e["call"] == "resume_memory_occupation" and e["args"] == [["weights"]]]
        record("test_three_step_staged_lifecycle", steps=steps, asleep_memory_before_step1=asleep_mem,
               greedy_ids={k: [ids for ids, _ in v] for k, v in greedy.items()},
               greedy_step1_vs_step2_max_logprob_diff=max(abs(x - y) for (_, a), (_, b) in zip(greedy[1], greedy[2]) for x, y in zip(a, b)),
               generations_outside_awake=lc.generations_outside_awake,
               generate_or_health_sent_outside_awake=len(client.sent_outside_awake),
               requests_sent=client.sent, gib_freed_by_each_release=freed,
               used_gib_after_resume_weights=[r["used_gib"] for r in resumed_w])
    finally:
        if lc.state is not EngineState.AWAKE:
            await lc.wake_up(Weights(state_dict=w_a, version="after-lifecycle"))
        await client.close()
