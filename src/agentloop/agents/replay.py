"""The `replay` agent loop, for benchmarks with random-weight models: turn lengths and tool latencies
come from a spec, not from what the model writes.

`sample.extra["replay"]` is a list of turns `{"gen_tokens": int, "tool_latency_s": float,
"tool_result_tokens": int}` (or `{"prompt_tokens": int, "turns": [...]}`). Each turn generates
exactly `gen_tokens` with `ignore_eos=True` (clamped by the token budget), then — unless it is the
last turn — sleeps `tool_latency_s` (a simulated tool) and appends `tool_result_tokens` fixed ids
with mask 0. A stop of the trajectory (early stop, sleep) ends the simulated tool at once: the
trajectory is aborted after its last model turn and, resumed, runs that tool call again. No chat template is needed: the prompt is `sample.extra["prompt_ids"]`, else the
sample's messages rendered by the tokenizer if there is one, else `prompt_tokens` fixed ids.
Token ids are drawn deterministically from the uid in `[replay_low_id, replay_high_id)` of
`config.extra` (defaults 3 and 200, valid in every test vocabulary), so different samples do not
share a prefix the engine could cache.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from ..types import Sample, Trajectory
from .base import AgentContext, AgentLoop
from .registry import register_agent
from .episode import BudgetSpent, Episode


#: `Trajectory.extra` key: the turn whose simulated tool call a stop cut (a resume runs it again).
INTERRUPTED_TOOL = "replay_interrupted_tool_turn"


@dataclass(frozen=True)
class ReplayTurn:
    gen_tokens: int
    tool_latency_s: float = 0.0
    tool_result_tokens: int = 0


def parse_spec(spec: Any, where: str = "sample.extra['replay']") -> tuple[int | None, list[ReplayTurn]]:
    """(prompt_tokens or None, turns) from a replay spec; ValueError naming the bad field."""
    prompt_tokens = None
    if isinstance(spec, dict):
        prompt_tokens = spec.get("prompt_tokens")
        if prompt_tokens is not None and (not isinstance(prompt_tokens, int) or prompt_tokens < 1):
            raise ValueError(f"{where}.prompt_tokens must be a positive int, got {prompt_tokens!r}")
        spec = spec.get("turns")
    if not isinstance(spec, list) or not spec:
        raise ValueError(f"{where} must be a non-empty list of turns, got {type(spec).__name__}")
    turns = []
    for i, t in enumerate(spec):
        if not isinstance(t, dict):
            raise ValueError(f"{where}[{i}] must be a mapping, got {type(t).__name__}")
        unknown = set(t) - {"gen_tokens", "tool_latency_s", "tool_result_tokens"}
        if unknown:
            raise ValueError(f"{where}[{i}]: unknown field(s) {sorted(unknown)}")
        gen = t.get("gen_tokens")
        if not isinstance(gen, int) or gen < 1:
            raise ValueError(f"{where}[{i}].gen_tokens must be a positive int, got {gen!r}")
        lat = t.get("tool_latency_s", 0.0)
        if not isinstance(lat, (int, float)) or lat < 0:
            raise ValueError(f"{where}[{i}].tool_latency_s must be a number >= 0, got {lat!r}")
        res = t.get("tool_result_tokens", 0)
        if not isinstance(res, int) or res < 0:
            raise ValueError(f"{where}[{i}].tool_result_tokens must be an int >= 0, got {res!r}")
        turns.append(ReplayTurn(gen, float(lat), res))
    return prompt_tokens, turns


def _fixed_ids(seed: str, n: int, low: int, high: int) -> list[int]:
    """`n` ids in `[low, high)` drawn by a numpy PCG64 seeded with crc32(seed): the prompt and every
    tool result of a replayed trajectory. Each seed gets its own sequence, so two samples share no
    cacheable prefix (an arithmetic progression mod the span, used before, has only `span` distinct
    sequences: with 1024 trajectories over 197 ids about half the prompts repeated, and how many
    repeats landed in one prefill batch differed between benchmark clients)."""
    span = max(1, high - low)
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    return (low + rng.integers(0, span, size=max(n, 0), dtype=np.int64)).tolist()


@register_agent
class ReplayAgent(AgentLoop):
    name = "replay"

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        low = int(ctx.config.extra.get("replay_low_id", 3))
        high = int(ctx.config.extra.get("replay_high_id", 200))
        try:
            prompt_tokens, turns = parse_spec(sample.extra.get("replay"))
            prompt_ids = sample.extra.get("prompt_ids")
            if prompt_ids is None and (ctx.tokenizer is None or prompt_tokens is not None):
                prompt_ids = _fixed_ids(f"{sample.uid}/prompt", prompt_tokens or 64, low, high)
            ep = Episode.start(sample, ctx, tools=sample.tools, prompt_ids=prompt_ids)
        except Exception as e:
            return Episode.failed_before_start(sample, ctx, e)
        assert ep.buffer is not None
        try:
            # A resumed replay goes on from the tool call a stop cut (run again), else from the turn
            # the abort cut (its open tokens count) or from the first turn not yet begun.
            interrupted = ep.extra.pop(INTERRUPTED_TOOL, None)
            open_len = len(ep.buffer.open_turn_ids)
            first = int(interrupted) if interrupted is not None else ep.assistant_turns - (1 if open_len else 0)
            for i in range(first, len(turns)):
                turn = turns[i]
                if interrupted is None or i != first:
                    want = turn.gen_tokens - (open_len if i == first else 0)
                    out = await ep.generate(max_new_tokens=max(1, want), ignore_eos=True)
                    if out.aborted:
                        ep.finish("aborted", "abort")
                        return ep.trajectory()
                    if len(out.output_ids) < max(1, want):
                        ep.finish("truncated", ep.extra.get("turn_cut_by", "length"))
                        return ep.trajectory()
                    if i == len(turns) - 1:
                        break
                t0 = ep.clock()
                with ep.ctx.interruptible() as wait:  # a stop ends the simulated tool at once
                    await anyio.sleep(turn.tool_latency_s)
                if wait.cancelled_caught:
                    ep.extra[INTERRUPTED_TOOL] = i
                    ep.finish("aborted", "abort")
                    return ep.trajectory()
                ids = _fixed_ids(f"{sample.uid}/tool{i}", turn.tool_result_tokens, low, high)
                ep.check_fits(len(ids) + 1)
                ep.buffer.append_tokens(ids)
                ep.event("tool", t0, ep.clock())
                ep.tool_calls += 1
                ep.metrics["tool_seconds"] += ep.clock() - t0
            ep.finish("completed", "stop")
        except BudgetSpent as b:
            ep.finish("truncated", b.reason)
        except Exception as e:
            ep.fail(e)
        return ep.trajectory()
