"""`Lifecycle.update_weights_in_flight` on the CPU engine (a real `agentloop serve` subprocess): requests
in flight across an update finish, every token is sampled by exactly one complete set of weights (the
old ones before the update, the new ones after: teacher forcing each set reproduces the engine's
logprobs), responses carry the version that finished them, generates arriving meanwhile wait at the
gate, 2+ updates in a row, the stages are recorded, and a failing update names its stage and leaves a
legal state. Plus the CPU engine's pause modes themselves: `retract` recomputes a paused request's
state under the new weights, `in_place` keeps the KV the old weights wrote (why the lifecycle retracts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from agentloop.engine.base import EngineError, GenerateOutput, SamplingParams
from agentloop.engine.lifecycle import EngineState, Lifecycle, LifecycleError, Weights
from agentloop.engine.sglang import SGLangClient

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

PROMPTS = [[3, 14, 15, 92, 6], [5, 35, 8, 97], [9, 32, 38, 46, 26, 4], [43, 38, 32, 7]]
#: EOS (ids 0 and 2 of the random model) pushed out with a logit bias, so requests run their length; the
#: scorer below adds the same bias (the engine's logprobs are of the processed logits, as SGLang's)
BIAS = {"0": -100.0, "2": -100.0}
LONG = SamplingParams(max_new_tokens=300, temperature=0.0, extra={"logit_bias": BIAS})
SHORT = SamplingParams(max_new_tokens=8, temperature=0.0, extra={"logit_bias": BIAS})
TOL = 2e-3  # CPU float32 across batch shapes and left padding (tests/test_agents_e2e.py uses 1e-3)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def models(random_model_dir: Path) -> dict[str, Any]:
    """The base model and two perturbed state dicts, each with a teacher-forcing scorer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(random_model_dir), dtype=torch.float32).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    sets = {"base": base}
    for name in ("w1", "w2", "w3"):
        sets[name] = {k: (v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 and v.numel() > 1 else v)
                      for k, v in base.items()}
        if model.config.tie_word_embeddings:  # one tensor in a tied model: the head is the embedding
            sets[name]["lm_head.weight"] = sets[name]["model.embed_tokens.weight"]

    def score(name: str, ids: list[int]) -> torch.Tensor:
        model.load_state_dict(sets[name])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logits[:, [int(t) for t in BIAS]] += torch.tensor(list(BIAS.values()))
        return torch.log_softmax(logits, dim=-1)

    return {"sets": sets, "score": score}


def who_sampled(models: dict[str, Any], prompt: list[int], out: GenerateOutput, names: list[str]) -> list[str]:
    """For each generated token, the one weight set whose teacher-forced logprob equals the engine's
    ("?" if none, "*" if several: ambiguous, never counted as a switch)."""
    ids = prompt + out.output_ids
    rows = {n: models["score"](n, ids) for n in names}
    who = []
    for j, (tok, lp) in enumerate(zip(out.output_ids, out.output_logprobs)):
        hits = [n for n in names if abs(rows[n][len(prompt) + j - 1, tok].item() - lp) <= TOL]
        who.append(hits[0] if len(hits) == 1 else ("*" if hits else "?"))
    return who


async def started(lc: Lifecycle, weights: Weights) -> None:
    """As a runtime does: attach, drain what the server holds, wake up with `weights`."""
    await lc.attach()
    await lc.sleep()
    await lc.wake_up(weights)


async def running(client: SGLangClient, n: int, min_tokens: int = 4) -> None:
    """Wait until `n` requests are running in the engine with at least some tokens decoded."""
    with anyio.fail_after(60):
        while True:
            info = (await client.server_info())["internal_states"][0]
            if info["num_running"] >= n and info["decode_steps"] >= min_tokens:
                return
            await anyio.sleep(0.01)


def segments(who: list[str]) -> list[str]:
    out: list[str] = []
    for w in who:
        if w != "*" and (not out or out[-1] != w):
            out.append(w)
    return out


async def test_requests_in_flight_cross_two_updates_with_exact_tokens(local_engine: str, models: dict[str, Any]) -> None:
    sets = models["sets"]
    async with SGLangClient(local_engine) as client:
        lc = Lifecycle([client], awake=False)
        try:
            await started(lc, Weights(state_dict=sets["w1"], version="v1"))
            outs: dict[int, GenerateOutput] = {}
            late: list[GenerateOutput] = []
            mark = lc.record_mark()

            async def one(i: int) -> None:
                outs[i] = await lc.generate(client.url, PROMPTS[i], LONG)

            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(one, i)
                await running(client, len(PROMPTS))
                assert await lc.update_weights_in_flight(Weights(state_dict=sets["w2"], version="v2")) == "v2"
                assert lc.state is EngineState.AWAKE and lc.weight_version == "v2"
                await running(client, 1, min_tokens=8)

                async def arrives_during_the_update() -> None:
                    late.append(await lc.generate(client.url, PROMPTS[0], SHORT))

                await lc.gate.close()  # as the next update does first: a generate arriving now waits at the gate
                tg.start_soon(arrives_during_the_update)
                await anyio.sleep(0.05)
                assert not late and lc.gate.in_flight() == len(PROMPTS)  # held at the gate, not dispatched
                assert await lc.update_weights_in_flight(Weights(state_dict=sets["w3"], version="v3")) == "v3"
            stages = [(r.phase, r.stage) for r in lc.records_since(mark)]
            assert stages == [("update_in_flight", s) for s in ("pause", "update_weights", "continue")] * 2
            names = ["w1", "w2", "w3"]
            switched = 0
            for i, out in outs.items():
                assert out.finish_reason["type"] == "length" and len(out.output_ids) == LONG.max_new_tokens
                who = who_sampled(models, PROMPTS[i], out, names)
                assert "?" not in who, (i, "".join(w[-1] for w in who))  # no token from a half-updated engine
                seq = segments(who)
                # the response carries the version that sampled its last tokens (SGLang's meta_info)
                assert out.weight_version == "v" + seq[-1][1:], (i, out.weight_version, seq)
                assert seq == sorted(seq) and len(seq) >= 2, (i, who)  # old weights first, then each newer one
                switched += seq == names
            assert switched >= 1  # (all crossed the first update, running before it; >= 1 crossed both)
            (after,) = late
            assert after.weight_version == "v3" and set(who_sampled(models, PROMPTS[0], after, names)) <= {"w3", "*"}
            assert lc.generations_outside_awake == 0
        finally:
            await lc.sleep()
            await lc.restore()  # the server goes back to the pool as found: base weights, awake


async def test_a_failed_update_names_its_stage_and_leaves_a_legal_state(local_engine: str, models: dict[str, Any]) -> None:
    sets = models["sets"]
    async with SGLangClient(local_engine) as client:
        lc = Lifecycle([client], awake=False)
        try:
            await started(lc, Weights(state_dict=sets["w1"], version="v1"))
            bad = {k: v[:1] if v.dim() == 2 else v for k, v in sets["w2"].items()}  # wrong shapes: refused
            with pytest.raises(LifecycleError) as e:
                await lc.update_weights_in_flight(Weights(state_dict=bad, version="v2"))
            assert e.value.stage == "update_weights" and lc.state is EngineState.DRAINING and lc.sleep_resume_at == "pause"
            assert not lc.gate.is_open and lc.weight_version == "v1"
            with pytest.raises(LifecycleError, match="call sleep"):
                await lc.wake_up(Weights(state_dict=sets["w2"], version="v2"))
            await lc.sleep()  # aborts what the pause held, flushes, releases
            assert await lc.wake_up(Weights(state_dict=sets["w2"], version="v2")) == "v2"
            out = await lc.generate(client.url, PROMPTS[1], SHORT)
            assert out.weight_version == "v2" and set(who_sampled(models, PROMPTS[1], out, ["w2"])) == {"w2"}
            # not AWAKE: refused, naming the stage
            await lc.sleep()
            with pytest.raises(LifecycleError, match="stage 'update_in_flight'.*SLEEPING, not AWAKE"):
                await lc.update_weights_in_flight(Weights(state_dict=sets["w3"], version="v3"))
        finally:
            await lc.sleep()
            await lc.restore()


async def test_cpu_engine_pause_modes_retract_recomputes_in_place_keeps_old_kv(
        local_engine: str, models: dict[str, Any]) -> None:
    """The engine side on its own (no lifecycle): SGLang's semantics of the two pause modes."""
    sets = models["sets"]
    async with SGLangClient(local_engine) as client:
        try:
            await client.update_weights_from_tensor(list(sets["w1"].items()), weight_version="v1")
            for mode in ("retract", "in_place"):
                out: list[GenerateOutput] = []

                async def one() -> None:
                    out.append(await client.generate(PROMPTS[2], LONG))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(one)
                    await running(client, 1, min_tokens=6)
                    await client.pause_generation(mode)
                    with pytest.raises(EngineError, match="would crash"):  # SGLang asserts its flush after the load
                        await client.update_weights_from_tensor(list(sets["w2"].items()), weight_version="v2")
                    await client.update_weights_from_tensor(list(sets["w2"].items()), weight_version="v2",
                                                            flush_cache=False)
                    assert not await client.flush_cache()  # a request is paused in the engine
                    await client.continue_generation()
                who = who_sampled(models, PROMPTS[2], out[0], ["w1", "w2"])
                first_new = next(j for j, w in enumerate(who) if w not in ("w1", "*"))
                if mode == "retract":  # KV recomputed under w2: every later token is w2's exactly
                    assert set(who[first_new:]) <= {"w2", "*"} and out[0].weight_version == "v2", who
                else:  # KV the old weights wrote is kept: the tokens right after are neither set's
                    assert who[first_new] == "?", who
                await client.update_weights_from_tensor(list(sets["w1"].items()), weight_version="v1")
        finally:
            await client.update_weights_from_tensor(list(sets["base"].items()), weight_version="default")
