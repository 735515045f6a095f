"""Real SGLang on the GPU: the runtime's full step with the tiny tool model and the `tool` agent loop.

SGLang (`agentloop.engine.launch`) serves the shipped tiny tool-calling model; `Runtime` drives it
for 3 steps (staged wake-up with weights from disk, then twice from the trainer's GPU state dict
over CUDA IPC → arithmetic prompts through the `tool` loop with the calculator → collate → sleep).
Checked on the real engine's output: trajectory invariants, mask-1 spans are exactly engine outputs
(same ids, same logprobs), mask-0 logprobs are 0, every turn carries the step's weight version,
teacher-forced logprobs of the same weights agree with SGLang's, tool calls happen, and no
`/generate` or `/health` ever went out outside AWAKE. The last test sends SGLang an
out-of-vocabulary id directly (which the client refuses to do) and records whether it survives.
"""

from __future__ import annotations

import os
import time

import pytest

from gpu_helpers import enabled  # noqa: E402

_ok, _why = enabled()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
import torch  # noqa: E402

import anyio  # noqa: E402

from agentloop.engine.base import EngineError, GenerateOutput, SamplingParams  # noqa: E402
from agentloop.engine.lifecycle import Weights  # noqa: E402
from agentloop.engine.sglang import SGLangClient  # noqa: E402

from gpu_helpers import RESULTS, InstrumentedClient, device, gpu_memory, launch, record  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.anyio]

STEPS, PROMPTS, N = 3, 16, 2


def _tiny_model():
    from pathlib import Path

    from agentloop.models import tiny_tool_model

    if os.environ.get("AGENTLOOP_GPU_TOOL_MODEL"):  # another tool-calling model folder
        return Path(os.environ["AGENTLOOP_GPU_TOOL_MODEL"])
    try:
        return tiny_tool_model()
    except FileNotFoundError as e:
        pytest.skip(f"tiny tool model not built: {e}")


@pytest.fixture(scope="module")
def tool_server():
    """SGLang serving the shipped tiny tool model (its real weights); stopped at module end."""
    model = _tiny_model()
    t0 = time.monotonic()
    server, command = launch("tool", model, mem_fraction=float(os.environ.get("AGENTLOOP_GPU_TOOL_MEM", "0.15")),
                             extra_args=tuple(os.environ.get("AGENTLOOP_GPU_TOOL_ARGS", "--dtype bfloat16").split()))
    RESULTS["servers"]["tool"] = {"command": command, "startup_seconds": round(time.monotonic() - t0, 1), "model": str(model)}
    try:
        yield server, model
    finally:
        proc = getattr(server, "proc", None) or getattr(server, "_proc", None)
        RESULTS["servers"]["tool"]["alive_at_end"] = proc is not None and proc.poll() is None
        anyio.run(server.stop)


class RecordingClient(InstrumentedClient):
    """Also keeps every generate's output, to match trajectories against what the engine returned."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.outputs: list[GenerateOutput] = []

    def __getattr__(self, name):
        call = super().__getattr__(name)
        if name != "generate":
            return call

        async def gen(*a, **kw):
            out = await call(*a, **kw)
            self.outputs.append(out)
            return out

        return gen


def samples(step: int):
    from agentloop.tasks.arithmetic import generate_questions
    from agentloop.types import Sample

    return [Sample(uid=f"s{step}-q{i}", messages=[{"role": "user", "content": q.question}], ground_truth=q.answer,
                   reward="arithmetic", agent="tool")
            for i, q in enumerate(generate_questions(PROMPTS, seed=100 + step))]


async def test_stop_token_ids_keep_the_matched_token(tool_server) -> None:
    """Runs first, while the fresh server is awake. With --skip-tokenizer-init, is a matched stop token
    the last of output_ids, with its logprob (the CPU engine's contract)? Each greedy run follows a
    cache flush, so both use the same kernels."""
    from transformers import AutoTokenizer

    from agentloop.engine.lifecycle import Lifecycle

    server, model_dir = tool_server
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 17 * 23 + 4?"}], tokenize=True,
                                     add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    async with SGLangClient(server.url, timeout=60) as c:
        lc = Lifecycle([c], awake=True)
        greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
        assert await c.flush_cache()
        free = await lc.generate(server.url, prompt, greedy)
        stop = free.output_ids[5]
        assert await c.flush_cache()
        # sglang 0.5.17 checks stop_token_ids only without ignore_eos (GPU run 2: with it, no stop)
        ignored = await lc.generate(server.url, prompt, greedy.replace(stop_token_ids=[stop]))
        assert await c.flush_cache()
        out = await lc.generate(server.url, prompt, greedy.replace(stop_token_ids=[stop], ignore_eos=False))
    eos = _eos_ids(model_dir)
    k = next(i for i, t in enumerate(free.output_ids) if t == stop or t in eos)
    record("test_stop_token_ids_keep_the_matched_token", unstopped=free.output_ids, stop_token=stop,
           with_ignore_eos={"ids": ignored.output_ids, "finish_reason": ignored.finish_reason},
           stopped=out.output_ids, finish_reason=out.finish_reason, stopped_logprobs=out.output_logprobs,
           unstopped_text=tok.decode(free.output_ids))
    assert ignored.finish_reason == {"type": "length", "length": 16}, "ignore_eos also ignores stop_token_ids"
    assert out.finish_reason == {"type": "stop", "matched": free.output_ids[k]}, out.finish_reason
    assert out.output_ids == free.output_ids[: k + 1], "the matched stop token is kept as the last id"
    assert len(out.output_logprobs) == len(out.output_ids)


def _eos_ids(model_dir) -> set[int]:
    import json

    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        v = json.loads((model_dir / name).read_text()).get("eos_token_id")
        ids |= set(v) if isinstance(v, list) else ({v} if v is not None else set())
    return ids


async def test_runtime_steps_with_tool_loop_on_sglang(tool_server) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from agentloop.runtime import Runtime

    server, model_dir = tool_server
    client = RecordingClient(SGLangClient(server.url, timeout=120))
    cfg = {"engine": {"tokenizer": str(model_dir), "request_timeout": 120},
           "scheduler": {"n": N, "concurrency": 64},
           "agent": {"max_assistant_turns": 4, "max_new_tokens_per_turn": 96, "max_response_tokens": 384,
                     "max_context_tokens": 1024, "sampling": {"temperature": 1.0}}}
    trainer_sd = {k: v.to(device()) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device()).eval()
    step_weights = [Weights(path=str(model_dir), version="step-1"),
                    Weights(state_dict=trainer_sd, version="step-2"),
                    Weights(state_dict=trainer_sd, version="step-3")]
    steps = []
    lp_diffs: list[float] = []
    async with Runtime(cfg, clients=[client]) as rt:
        client.lifecycle = rt.lifecycle
        for k, w in enumerate(step_weights, start=1):
            n_out, n_ev = len(client.outputs), len(client.events)
            res = await rt.step(samples(k), w)
            trajs = res.trajectories
            assert res.weight_version == f"step-{k}"
            assert len(trajs) == PROMPTS * N
            engine_spans: dict[tuple[int, ...], list[list[float]]] = {}  # identical ids can come back twice
            for o in client.outputs[n_out:]:
                engine_spans.setdefault(tuple(o.output_ids), []).append(o.output_logprobs)
            for t in trajs:
                t.check_invariants()
                assert t.status in ("completed", "truncated"), (t.status, t.error)
                assert {tr.weight_version for tr in t.turns} == {f"step-{k}"}
                for m, lp in zip(t.response_mask, t.response_logprobs):
                    assert (lp == 0.0) if m == 0 else (lp <= 0.0)
                for tr in t.turns:  # every model turn is one engine output, verbatim
                    span = tuple(t.response_ids[tr.start: tr.start + tr.length])
                    assert span in engine_spans, "a mask-1 span is not what the engine returned"
                    assert t.response_logprobs[tr.start: tr.start + tr.length] in engine_spans[span]
            # teacher forcing the same weights gives SGLang's logprobs (a sample of trajectories)
            for t in trajs[:8]:
                ids = torch.tensor([t.prompt_ids + t.response_ids], device=device())
                with torch.no_grad():
                    logp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
                p = len(t.prompt_ids)
                lp_diffs += [abs(logp[p + j - 1, tok].item() - lp)
                             for j, (tok, m, lp) in enumerate(zip(t.response_ids, t.response_mask, t.response_logprobs)) if m]
            m = res.metrics
            steps.append({
                "step": k, "weight_version": res.weight_version, "trajectories": len(trajs),
                "status_counts": m.get("status_counts"), "tool_calls": sum(t.tool_calls for t in trajs),
                "mean_reward": sum((t.reward or 0.0) for t in trajs) / len(trajs),
                "response_tokens": sum(len(t.response_ids) for t in trajs),
                "sampled_tokens": sum(sum(t.response_mask) for t in trajs),
                "wake_up_seconds": round(m["wake_up_seconds"], 4), "rollout_seconds": round(m["rollout_seconds"], 3),
                "sleep_seconds": round(m["sleep_seconds"], 4),
                "stage_seconds": {s: round(v, 4) for s, v in m["stage_seconds"].items()},
                "memory_after_each_call": client.events[n_ev:],
            })
        assert rt.lifecycle.generations_outside_awake == 0
    assert client.sent_outside_awake == []
    assert sum(s["tool_calls"] for s in steps) > 0, "the tiny tool model made no tool call on SGLang"
    mean_diff = sum(lp_diffs) / max(1, len(lp_diffs))
    record("test_runtime_steps_with_tool_loop_on_sglang", steps=steps, requests_sent=client.sent,
           generate_or_health_sent_outside_awake=len(client.sent_outside_awake),
           teacher_forced_logprob_abs_diff={"mean": mean_diff, "max": max(lp_diffs, default=0.0), "tokens": len(lp_diffs)},
           memory_end=gpu_memory())
    # SGLang serves the float32 checkpoint in bf16 (--dtype bfloat16, as RL runs do; its "auto" would
    # pick fp16): agreement within bf16 rounding of a float32 reference, not bit-exact
    assert mean_diff < 0.1, mean_diff


async def test_out_of_vocab_id_sent_to_real_sglang(tool_server) -> None:
    """The client refuses such ids (sglang 0.5.17 never checks them); here one goes out anyway."""
    import aiohttp

    server, model_dir = tool_server
    async with SGLangClient(server.url, timeout=60) as c:
        vocab = await c.served.resolve_vocab_size()
        assert vocab, "the client should learn the vocab size from the served folder's config.json"
        with pytest.raises(EngineError, match="refused before sending"):
            await c.generate([1, vocab + 3], SamplingParams(max_new_tokens=2))
    outcome: dict = {"vocab_size": vocab}
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/generate", json={"input_ids": [1, 2, vocab + 3],
                              "sampling_params": {"max_new_tokens": 2}}, timeout=aiohttp.ClientTimeout(total=20)) as r:
                outcome.update(status=r.status, body=(await r.text())[:1000])
    except Exception as e:  # the server may die mid-request
        outcome["error"] = f"{type(e).__name__}: {e}"
    await anyio.sleep(3)
    try:
        async with SGLangClient(server.url, timeout=10, retries=0) as c:
            await c.model_info()
            outcome["server_alive_after"] = True
    except EngineError:
        outcome["server_alive_after"] = False
    record("test_out_of_vocab_id_sent_to_real_sglang", **outcome)
