"""Helpers for the scheduler/router unit tests: an in-process engine double and a scripted agent loop.

The engine double keeps SGLang's rules that matter to routing and stopping (generate refused while
memory is released, abort by rid / pause(abort) end a request with finish_reason "abort" and the
tokens so far, a killed server is unreachable) and records what it was asked. The agent loop
`scripted` runs `extra["turns"]` model turns separated by fake tool segments, through
`AgentContext.generate` and the real `TokenBuffer`, and resumes partial trajectories.
"""

from __future__ import annotations

from typing import Any, Sequence

import anyio

from agentloop.agents import AgentContext, AgentLoop, register_agent
from agentloop.chat import TokenBuffer
from agentloop.engine.base import EngineError, EngineUnavailable, GenerateOutput, SamplingParams
from agentloop.types import Sample, TimelineEvent, Trajectory

TOOL_TOKENS = [900, 901, 902]


class FakeEngine:
    """A deterministic engine: token t of a request is (len(input) + t) % 500 + 1, logprob -0.25."""

    def __init__(self, url: str, *, token_delay: float = 0.002, version: str = "default") -> None:
        self.url = url
        self.token_delay = token_delay
        self.weight_version = version
        self.released: set[str] = set()
        self.dead = False
        self.paused_abort = False
        self.aborted: set[str] = set()
        self.running: set[str] = set()  # rids of the generates in progress (what abort_all aborts)
        self.abort_calls: list[str | None] = []  # each /abort_request: its rid, None for abort_all
        self.in_flight = 0
        self.max_in_flight = 0
        self.generates: list[tuple[str, int]] = []  # (rid, len(input_ids))
        self.error_next: EngineError | None = None
        self.calls: list[str] = []
        # Counted where the request "leaves", as SGLangClient does (the gate calls watch_gate).
        self.gate_open: Any = None
        self.sent_outside_awake = 0

    def watch_gate(self, is_open: Any) -> None:
        """`engine.gate.GateWatched`, as SGLangClient."""
        self.gate_open = is_open

    def _check(self, endpoint: str) -> None:
        if self.dead:
            raise EngineUnavailable(endpoint, None, "connection refused", url=self.url)

    async def generate(self, input_ids: Sequence[int], sampling_params: SamplingParams, *, rid: str | None = None,
                       return_logprob: bool = True, timeout: float | None = None) -> GenerateOutput:
        self._check("/generate")
        if self.gate_open is not None and not self.gate_open():
            self.sent_outside_awake += 1
        if self.error_next is not None:
            e, self.error_next = self.error_next, None
            raise e
        if self.released:
            raise EngineError("/generate", 400, f"memory released: {sorted(self.released)}", url=self.url)
        rid = rid or "anon"
        self.generates.append((rid, len(input_ids)))
        self.running.add(rid)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            out: list[int] = []
            for _ in range(sampling_params.max_new_tokens):
                if rid in self.aborted or self.paused_abort:
                    return self._out(out, {"type": "abort", "message": "Abort"}, rid)
                await anyio.sleep(self.token_delay)
                if self.dead:
                    raise EngineUnavailable("/generate", None, "connection reset", url=self.url)
                out.append((len(input_ids) + len(out)) % 500 + 1)
            return self._out(out, {"type": "length", "length": len(out)}, rid)
        finally:
            self.in_flight -= 1
            self.running.discard(rid)

    def _out(self, ids: list[int], finish: dict[str, Any], rid: str) -> GenerateOutput:
        return GenerateOutput(ids, [-0.25] * len(ids), finish, self.weight_version, rid, server_url=self.url)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self._check("/release_memory_occupation")
        self.calls.append("release")
        self.released.update(tags or ())

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self._check("/resume_memory_occupation")
        self.calls.append("resume")
        self.released.difference_update(tags or ())

    async def _update_lock(self, abort_all_requests: bool) -> None:
        """SGLang's `model_update_lock` seen from an update: with `abort_all_requests` everything is
        aborted first, and the load waits until no generate is in progress."""
        if abort_all_requests:
            self.aborted.update(self.running)
        while self.in_flight:
            await anyio.sleep(self.token_delay)

    async def update_weights_from_disk(self, model_path: str, *, load_format=None, weight_version=None,
                                       flush_cache=True, abort_all_requests=False) -> dict[str, Any]:
        self._check("/update_weights_from_disk")
        await self._update_lock(abort_all_requests)
        self.calls.append("update")
        self.weight_version = weight_version or self.weight_version
        return {"success": True}

    async def update_weights_from_tensor(self, named_tensors, *, load_format=None, weight_version=None,
                                         flush_cache=True, abort_all_requests=False) -> dict[str, Any]:
        self._check("/update_weights_from_tensor")
        await self._update_lock(abort_all_requests)
        self.calls.append("update")
        self.weight_version = weight_version or self.weight_version
        return {"success": True}

    async def flush_cache(self) -> bool:
        self._check("/flush_cache")
        return self.in_flight == 0

    async def pause_generation(self, mode: str = "abort") -> None:
        self._check("/pause_generation")
        self.paused_abort = mode == "abort"

    async def continue_generation(self) -> None:
        self._check("/continue_generation")
        self.paused_abort = False

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        self._check("/abort_request")
        self.abort_calls.append(None if abort_all else rid)
        if abort_all:  # as SGLang: every request the server has now
            self.aborted.update(self.running)
        elif rid:
            self.aborted.add(rid)

    async def health(self) -> bool:
        self._check("/health")
        return True

    async def model_info(self) -> dict[str, Any]:
        self._check("/model_info")
        return {"model_path": "/fake/model", "weight_version": self.weight_version}

    async def server_info(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        pass


@register_agent
class ScriptedLoop(AgentLoop):
    """`extra["turns"]` model turns of `extra["tokens"]` tokens, `extra["tool_delay"]` s of "tool" between;
    `extra["raise"]` raises inside the loop. Ends aborted when a turn is aborted."""

    name = "scripted"

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        ex = sample.extra
        if ex.get("raise"):
            raise ValueError(f"scripted failure in {sample.uid}")
        if sample.resume_from is not None:
            buf = TokenBuffer.from_trajectory(sample.resume_from, None)
            timeline = list(sample.resume_from.timeline)
        else:
            buf = TokenBuffer(None, prompt_ids=[1, 2, 3, len(sample.uid)])
            timeline = []
        clock = ctx.clock or anyio.current_time
        while len(buf.turns) < ex.get("turns", 2):
            if buf.turns and buf.response_mask[-1] == 1 and buf.turns[-1].finish_reason.get("type") != "abort":
                t0 = clock()
                await anyio.sleep(ex.get("tool_delay", 0.0))
                buf.append_tokens(TOOL_TOKENS)
                timeline.append(TimelineEvent("tool", t0, clock()))
            out = await ctx.generate(buf.ids, ctx.config.turn_sampling().replace(max_new_tokens=ex.get("tokens", 4)))
            if out.output_ids or not out.aborted:
                buf.append_model_turn(out)
            if out.aborted:
                return buf.to_trajectory(sample.uid, sample.group_id, status="aborted", finish_reason="abort",
                                         num_turns=len(buf.turns), timeline=timeline)
        return buf.to_trajectory(sample.uid, sample.group_id, status="completed", finish_reason="length",
                                 num_turns=len(buf.turns), timeline=timeline)


async def length_reward(trajectory: Trajectory, sample: Sample, *, timeout: float) -> float:
    if sample.extra.get("bad_reward"):
        raise KeyError("no ground truth")
    return float(len(trajectory.response_ids))


def samples(n: int, **extra: Any) -> list[Sample]:
    return [Sample(uid=f"p{i}", messages=[{"role": "user", "content": f"q{i}"}], agent="scripted", extra=dict(extra))
            for i in range(n)]
