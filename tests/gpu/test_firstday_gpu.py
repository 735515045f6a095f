"""A GPU user's first day on real SGLang with the shipped tiny tool model: `agentloop rollout --engine-url`
with default settings (scheduler.concurrency: auto reads the server's running-batch cap), and the
OpenAI-compatible agent loop (a user's `openai.AsyncOpenAI` agent) driven through the same runtime.

Checked on the real engine: the command exits 0 and writes every output (training.png included); the
concurrency used is the server's `/server_info` capacity (internal_states[].effective_max_running_requests_per_dp),
not a CPU-made number, and summary.json says how busy it kept the engine; rewards are the shipped
model's (~0.96 by hand on an H200); the OpenAI agent's mask-1 tokens are exactly the engine's sampled
ids with their logprobs, and no generate went out outside AWAKE. Skipped without a CUDA GPU and sglang
(`AGENTLOOP_GPU_DRYRUN=1`: the same tests against the CPU engine, to debug the test code).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpu_helpers import enabled  # noqa: E402

_ok, _why = enabled()
if not _ok:
    pytest.skip(_why, allow_module_level=True)

import anyio  # noqa: E402

from gpu_helpers import DRYRUN, RESULTS, launch, record  # noqa: E402

pytestmark = [pytest.mark.gpu]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_server():
    """SGLang serving the shipped tiny tool model; stopped at module end."""
    from agentloop.models import tiny_tool_model

    model = tiny_tool_model()
    t0 = time.monotonic()
    server, command = launch("firstday", model, mem_fraction=float(os.environ.get("AGENTLOOP_GPU_TOOL_MEM", "0.2")),
                             extra_args=() if DRYRUN else ("--dtype", "bfloat16"))
    RESULTS["servers"]["firstday"] = {"command": command, "startup_seconds": round(time.monotonic() - t0, 1)}
    try:
        yield server, model
    finally:
        anyio.run(server.stop)


def test_rollout_engine_url_with_default_settings(tiny_server, tmp_path: Path) -> None:
    server, _ = tiny_server
    out = tmp_path / "out"
    steps, prompts, n = (2, 32, 4) if not DRYRUN else (2, 4, 2)
    cmd = [sys.executable, "-m", "agentloop", "rollout", "--engine-url", server.url, "--steps", str(steps),
           "--prompts-per-step", str(prompts), "--n", str(n), "--out", str(out), "--quiet"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    wall = time.monotonic() - t0
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    conc, use = summary.get("concurrency") or {}, summary.get("engine_use") or {}
    record("test_rollout_engine_url_with_default_settings", command=" ".join(cmd[1:]), exit_status=proc.returncode,
           wall_seconds=round(wall, 1), stderr_tail=proc.stderr[-3000:], stdout=proc.stdout[-2000:],
           concurrency=conc, engine_use=use, tokens_per_second=summary.get("tokens_per_second"),
           status=summary.get("status"), reward_mean=summary.get("reward_mean"), tool_calls=summary.get("tool_calls"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unreachable" not in proc.stderr  # nothing is wrong: nothing is said
    assert summary["trajectories"] == steps * prompts * n
    assert summary["status"]["completed"] >= 0.9 * summary["trajectories"], summary["status"]
    assert summary["reward_mean"] >= 0.8  # the shipped model: ~0.96 on SGLang by hand
    assert summary["tool_calls"] > 0
    # concurrency: auto, from what the server reports (not the CPU engine's 64 on real SGLang)
    assert conc["setting"] == "auto"
    (info,) = conc["per_server"].values()
    assert info["engine"] == ("cpu" if DRYRUN else "sglang")
    assert conc["engine_capacity"] == info["max_running_requests"] and conc["engine_capacity"] > 0
    if not DRYRUN:
        assert conc["used"] == conc["engine_capacity"]
    assert f"concurrency {conc['used']}, engine busy" in proc.stderr
    for ps in summary["per_step"]:
        assert 0 < ps["engine_use"]["engine_busy_fraction"] <= 1
    for name in ("trajectories.jsonl", "trajectories.parquet", "timeline.png", "training.png"):
        assert (out / name).stat().st_size > 0, name



async def calculator_agent(client, sample):  # noqa: ANN001, ANN201
    """A user's agent on the official client: ask, run the calculator for each tool call, answer."""
    from agentloop.tasks.arithmetic import CALCULATOR_TOOL, evaluate_expression

    messages = list(sample.messages)
    for _ in range(4):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL],
                                                 max_tokens=64)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content
        for call in msg.tool_calls:
            try:
                result = str(evaluate_expression(json.loads(call.function.arguments)["expression"]))
            except Exception as e:  # noqa: BLE001  (a bad call is answered, as a tool would)
                result = f"Error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def test_openai_compatible_agent_on_sglang(tiny_server) -> None:
    pytest.importorskip("openai", reason="the openai agent loop needs the openai client")
    from agentloop.engine.lifecycle import EngineState
    from agentloop.runtime import Runtime
    from agentloop.tasks.arithmetic import generate_questions
    from agentloop.types import Sample

    server, _ = tiny_server
    prompts, n = (32, 4) if not DRYRUN else (4, 2)
    config = {"engine": {"urls": [server.url]}, "scheduler": {"n": n},
              "agent": {"agent": "openai", "max_new_tokens_per_turn": 64, "max_response_tokens": 512}}
    per_step = []
    with Runtime(config) as rt:
        client = rt.clients[0]
        raw = client.generate
        outputs: list[tuple[list[int], Any]] = []
        states: list[Any] = []

        async def recording(input_ids, params, **kw):  # noqa: ANN001, ANN202
            out = await raw(input_ids, params, **kw)
            outputs.append((list(input_ids), out))
            return out

        client.generate = recording  # type: ignore[method-assign]
        assert rt.lifecycle is not None
        rt.lifecycle.on_generate = lambda url, state: states.append(state)
        for step in (1, 2):
            samples = [Sample(uid=f"s{step}q{i}", messages=[{"role": "user", "content": q.question}],
                              ground_truth=q.answer, extra={"function": calculator_agent})
                       for i, q in enumerate(generate_questions(prompts, seed=500 + step))]
            res = rt.step_sync(samples)
            rewards = [t.reward for t in res.trajectories if t.reward is not None]
            per_step.append({"trajectories": len(res.trajectories), "status": res.metrics["status_counts"],
                             "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                             "tool_calls": sum(t.tool_calls for t in res.trajectories)})
            assert len(res.trajectories) == prompts * n
            for t in res.trajectories:
                if t.status not in ("completed", "truncated"):
                    continue
                t.check_invariants()
                full = t.prompt_ids + t.response_ids
                for turn in t.turns:  # every model turn is exactly an engine output for its input
                    prefix = full[: len(t.prompt_ids) + turn.start]
                    ids = t.response_ids[turn.start: turn.start + turn.length]
                    lps = t.response_logprobs[turn.start: turn.start + turn.length]
                    assert any(inp == prefix and o.output_ids == ids and o.output_logprobs == lps
                               for inp, o in outputs), f"{t.uid}: a turn is not an engine output"
        outside = rt.lifecycle.generations_outside_awake
        assert all(s is EngineState.AWAKE for s in states)
    record("test_openai_compatible_agent_on_sglang", steps=per_step, generations_outside_awake=outside)
    assert outside == 0
    for s in per_step:
        assert s["status"]["completed"] >= 0.9 * s["trajectories"], s
        assert s["reward_mean"] is not None and s["reward_mean"] >= 0.8, s  # ~0.93-0.95 by hand
        assert s["tool_calls"] > 0
