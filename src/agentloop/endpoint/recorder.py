"""One trajectory's side of the endpoint: each chat-completions call answered and recorded with exact tokens.

`TrajectoryRecorder.complete(request)` turns one request into one model turn of the trajectory:

- **Extension** (the common case): the request's messages are a conversation the recorder has seen —
  the prompt, the assistant messages it returned, what was appended since — followed by new messages
  (tool results, a user turn). Only the new part is appended, as the chat-template delta (mask 0)
  after the recorded model tokens (`Episode.append_messages`); the assistant turns the agent sends
  back are compared with what was returned (`protocol.message_key`), never re-tokenized.
- **Rewrite**: anything else — earlier turns dropped, edited or summarized, other tools, a template
  that has no clean delta for the new messages — starts a new *segment*: the request's messages are
  rendered as a fresh prompt and the turn is recorded there. A request that extends an earlier segment
  (an agent alternating between conversations) continues that segment. Every segment is its own
  token sequence; `trajectory()` returns the segment of the last call with the others in
  `Trajectory.segments`, each flagged (`extra["history_rewritten"]`, `segment_index`, `segment_reason`).
- **Generation** goes through the `AgentContext.generate` the scheduler bound to this trajectory (its
  sticky route and the lifecycle gate), with the budget, turn limit and metrics of `Episode`. String
  `stop`s are matched on the decoded turn and the sampled ids are cut after the token that completes
  the stop (the engine runs without a tokenizer): the ids kept are still exactly the sampled ones.

A request for a trajectory that was stopped (runtime sleep, early stop, timeout) or whose call was
aborted is refused with a 503; a spent budget or turn limit with a 400 (`context_length_exceeded`,
`max_assistant_turns`), after which an agent may still summarize and go on in a new segment.
Requests of one trajectory are answered one at a time, in arrival order.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import anyio

from ..agents.base import AgentContext
from ..agents.episode import BudgetSpent, Episode
from ..agents.tool import assistant_message
from ..chat import ChatTemplateError
from ..engine.base import EngineError, GenerateOutput, SamplingParams
from ..input_budget import bytes_budget
from ..rewards import RewardResult, to_reward_result
from ..tools import get_parser
from ..types import Sample, Trajectory, TrajectoryStatus
from .protocol import ChatCompletionRequest, CompletionResult, EndpointError, message_key, normalize_messages

__all__ = ["Segment", "TrajectoryRecorder", "cut_at_stop"]

#: Conversations with more characters than this are rendered and tokenized in a worker thread (the
#: chat template and the tokenizer take ~1 s per MB: on the event loop that would stall every trajectory).
OFF_LOOP_CHARS = 64 * 1024


def _chars(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else len(str(m.get("content")))
               for m in messages)


@dataclass
class Segment:
    """One token sequence of a trajectory: an `Episode` and the conversation its tokens hold."""

    index: int
    #: Why it began: "start" (the first call), "history_rewritten", "tools_changed" or "no_template_delta".
    reason: str
    episode: Episode
    tools_key: str
    #: `message_key` of every message the tokens hold, in order.
    keys: list[str] = field(default_factory=list)
    #: The tokens end with a sampled model turn (so new messages are appended as a delta).
    replied: bool = False


def cut_at_stop(out: GenerateOutput, stops: Sequence[str], tokenizer: Any) -> GenerateOutput:
    """`out` cut after the first token whose text completes one of `stops` (the earliest in the text),
    with finish reason `{"type": "stop", "matched": stop}`; unchanged if no stop occurs. The kept ids
    and logprobs are a prefix of the sampled ones."""
    ids = out.output_ids
    text = tokenizer.decode(ids, skip_special_tokens=False)
    found = [(text.find(s), s) for s in stops if s and s in text]
    if not found:
        return out
    _, stop = min(found)
    lo, hi = 1, len(ids)  # smallest k whose decoded prefix contains the stop
    while lo < hi:
        mid = (lo + hi) // 2
        if stop in tokenizer.decode(ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return dataclasses.replace(out, output_ids=ids[:lo], output_logprobs=out.output_logprobs[:lo],
                               finish_reason={"type": "stop", "matched": stop}, completion_tokens=lo)


class TrajectoryRecorder:
    """Answers and records the calls of one trajectory (see the module docstring)."""

    def __init__(self, sample: Sample, ctx: AgentContext) -> None:
        self.sample = sample
        self.ctx = dataclasses.replace(ctx, generate=self._generate)
        self.parser = get_parser(ctx.config.tool_parser)
        self.segments: list[Segment] = []
        self.current: Segment | None = None  #: the segment of the last answered call
        self.calls: list[dict[str, Any]] = []  #: one record per answered call
        #: (status, finish reason) of the last call refused for a budget or limit; cleared by an answered call.
        self.refusal: tuple[TrajectoryStatus, str] | None = None
        #: Why calls are refused from now on (the trajectory was stopped or its call aborted).
        self.stopped: str | None = None
        self._lock = anyio.Lock()
        self._stops: list[str] = []
        self._call_ids = itertools.count()
        self._generate_fn = ctx.generate

    @property
    def max_request_bytes(self) -> int:
        """Request bodies larger than this cannot fit the trajectory's context (refused before parsing)."""
        return bytes_budget(self.ctx.config.max_context_tokens)

    # ------------------------------------------------------------------ one call
    async def complete(self, req: ChatCompletionRequest) -> CompletionResult:
        async with self._lock:
            return await self._complete(req)

    async def _complete(self, req: ChatCompletionRequest) -> CompletionResult:
        if self.stopped is not None:
            raise EndpointError(503, f"refused, nothing generated: {self.stopped}", type="server_error",
                                code="trajectory_stopped")
        cfg = self.ctx.config
        if sum(s.episode.assistant_turns for s in self.segments) >= cfg.max_assistant_turns:
            self.refusal = ("truncated", "max_assistant_turns")
            raise EndpointError(400, f"this trajectory has used its {cfg.max_assistant_turns} model turns "
                                "(agent.max_assistant_turns)", code="max_assistant_turns")
        if len(req.messages) > cfg.max_context_tokens:  # every message is at least one token
            raise self._budget_error("max_context_tokens")
        messages = normalize_messages(req.messages)
        try:
            if _chars(messages) > OFF_LOOP_CHARS:  # rendering and tokenizing this takes long: not on the loop
                seg = await anyio.to_thread.run_sync(self._place, messages, req.tools or None)
            else:
                seg = self._place(messages, req.tools or None)
        except BudgetSpent as b:
            raise self._budget_error(b.reason) from None
        ep = seg.episode
        assert ep.buffer is not None
        prompt_tokens = ep.buffer.total_len
        limit = cfg.max_new_tokens_per_turn
        want = min(req.requested_max_tokens or limit, limit)
        overrides = req.sampling_overrides()
        if "extra" in overrides:
            overrides["extra"] = {**ep.sampling.extra, **overrides["extra"]}
        self._stops = req.stops
        try:
            out = await ep.generate(max_new_tokens=want, **overrides)
        except BudgetSpent as b:
            raise self._budget_error(b.reason) from None
        except EngineError as e:
            raise EndpointError(502, f"the engine failed this call: {e}", type="server_error", code="engine_error") from e
        if out.aborted:  # stopped (sleep, early stop, timeout) before or while generating
            why = out.finish_reason.get("message") or "abort"
            if out.output_ids:
                self.stopped = f"the call was aborted after {len(out.output_ids)} tokens ({why})"
                raise EndpointError(503, self.stopped, type="server_error", code="aborted")
            self.stopped = f"the trajectory was stopped ({why})"
            raise EndpointError(503, f"refused, nothing generated: {self.stopped}", type="server_error",
                                code="trajectory_stopped")
        return self._answer(seg, req, out, prompt_tokens)

    def _budget_error(self, reason: str) -> EndpointError:
        self.refusal = ("truncated", reason)
        return EndpointError(400, f"the conversation does not fit this trajectory's token budget (agent.{reason}); "
                             "shorten it (a rewritten history starts a new training segment)",
                             code="context_length_exceeded", param="messages")

    def _place(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Segment:
        """The segment this request continues, with its new messages appended; else a new segment."""
        keys = [message_key(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True, default=str)
        reason = "history_rewritten"
        # The longest held conversation first (the most sampled tokens reused as they are), then the
        # last call's segment.
        ordered = sorted(self.segments, key=lambda s: (-len(s.keys), s is not self.current))
        for seg in ordered:
            n = len(seg.keys)
            if keys[:n] != seg.keys:
                continue
            if not seg.replied and len(keys) == n:
                return seg  # the same request again after a failed call: generate where it stopped
            if not seg.replied or len(keys) == n:
                continue
            if seg.tools_key != tools_key:
                reason = "tools_changed"
                continue
            try:
                seg.episode.append_messages(messages[n:])
            except ChatTemplateError:
                reason = "no_template_delta"
                continue
            seg.keys, seg.replied = keys, False
            return seg
        try:
            ep = Episode.start(dataclasses.replace(self.sample, messages=messages, resume_from=None), self.ctx, tools=tools)
        except ChatTemplateError as e:
            raise EndpointError(400, f"the model's chat template cannot render these messages: {e}", param="messages") from e
        seg = Segment(len(self.segments), "start" if not self.segments else reason, ep, tools_key, keys)
        self.segments.append(seg)
        ep.check_fits(1)
        return seg

    async def _generate(self, input_ids: list[int], params: SamplingParams) -> GenerateOutput:
        out = await self._generate_fn(input_ids, params)
        if self._stops and out.output_ids and not out.aborted:
            out = cut_at_stop(out, self._stops, self.ctx.tokenizer)
        return out

    def _answer(self, seg: Segment, req: ChatCompletionRequest, out: GenerateOutput, prompt_tokens: int) -> CompletionResult:
        ep = seg.episode
        assert ep.buffer is not None
        text = ep.turn_text()
        matched = out.finish_reason.get("matched")
        if isinstance(matched, str) and matched in text:
            text = text[: text.find(matched)]  # OpenAI leaves the stop sequence out of the content
        content, calls = self.parser.parse(text) if req.parse_tool_calls else (text, [])
        named = [c for c in calls if c.name]
        # A call the model wrote without a usable name cannot be a tool call: the agent reads it as text.
        unnamed = [c.raw for c in calls if not c.name]
        if unnamed:
            content = "\n".join([content, *unnamed]).strip()
        for c in named:
            c.id = f"call_{self.sample.uid}_{next(self._call_ids)}"
        message = assistant_message(content, named)
        if named and not content:
            message["content"] = None
        ep.show_assistant(message)
        ep.tool_calls += len(named)
        seg.keys.append(message_key(normalize_messages([message])[0]))
        seg.replied = True
        self.current, self.refusal = seg, None
        turn = ep.buffer.turns[-1]
        finish = "tool_calls" if named else ("length" if out.finish_type == "length" else "stop")
        self.calls.append({"segment": seg.index, "turn": len(ep.buffer.turns) - 1, "rid": out.rid,
                           "prompt_tokens": prompt_tokens, "completion_tokens": turn.length, "finish_reason": finish})
        logprobs = None
        if req.logprobs:
            ids = ep.buffer.response_ids[turn.start: turn.start + turn.length]
            lps = ep.buffer.response_logprobs[turn.start: turn.start + turn.length]
            logprobs = [(ep.buffer.decode([i]), lp) for i, lp in zip(ids, lps)]
        return CompletionResult(
            id=f"chatcmpl-{out.rid or next(self._call_ids)}", message=message, finish_reason=finish,  # type: ignore[arg-type]
            prompt_tokens=prompt_tokens, completion_tokens=turn.length, cached_tokens=out.cached_tokens,
            weight_version=out.weight_version, segment=seg.index, logprobs=logprobs,
        )

    # ------------------------------------------------------------------ the hand-off
    def trajectory(self, *, value: Any = None, error: BaseException | None = None, name: str = "agent") -> Trajectory:
        """The trajectory of this run: the last call's segment, earlier ones in `segments`; reward from
        `value` when the agent returned one (a number, a `RewardResult` or a dict with "reward")."""
        if not self.segments:
            exc = error or RuntimeError(f"the agent function {name!r} returned without calling the model")
            return Episode.failed_before_start(self.sample, self.ctx, exc)
        status, reason = self._outcome(error)
        # A segment whose every call was refused holds no sampled token: it is no training row.
        segments = [s for s in self.segments if s.episode.buffer is not None and s.episode.buffer.turns]
        segments = segments or [self.segments[-1]]
        main_seg = self.current or segments[-1]  # the current segment always holds a turn
        rows: list[Trajectory] = []
        for seg in segments:
            ep = seg.episode
            if status == "failed" and error is not None:
                ep.fail(error)
            else:
                ep.finish(status, reason)
            t = ep.trajectory()
            t.extra.update(segment_index=seg.index, segment_reason=seg.reason)
            rows.append(t)
        main = rows[segments.index(main_seg)]
        if len(rows) > 1:
            for seg, t in zip(segments, rows):
                t.extra.update(history_rewritten=True, segment_count=len(rows), segment_of=self.sample.uid)
                if t is not main:
                    t.uid = f"{self.sample.uid}/segment-{seg.index}"
            main.segments = [t for t in rows if t is not main]
        main.extra["openai_calls"] = list(self.calls)
        self._reward(main, value, name)
        return main

    def _outcome(self, error: BaseException | None) -> tuple[TrajectoryStatus, str]:
        if self.stopped is not None:
            return "aborted", "abort"
        if self.refusal is not None:
            return self.refusal
        if error is not None:
            return "failed", "error"
        last = (self.current or self.segments[-1]).episode
        if last.buffer is not None and last.buffer.turns and last.buffer.turns[-1].finish_reason.get("type") == "length":
            return "truncated", last.extra.get("turn_cut_by", "length")
        return "completed", "stop"

    @staticmethod
    def _reward(traj: Trajectory, value: Any, name: str) -> None:
        if value is None:
            return
        if isinstance(value, (numbers.Real, RewardResult)) or (isinstance(value, Mapping) and "reward" in value):
            try:
                result = to_reward_result(value, name)
            except (TypeError, ValueError) as e:
                traj.status, traj.finish_reason, traj.error = "failed", "error", f"agent's reward: {e}"
                return
            traj.reward = result.reward
            if result.turn_rewards is not None:
                traj.turn_rewards = list(result.turn_rewards)
            if result.info:
                traj.extra["reward_info"] = dict(result.info)
            return
        traj.extra["agent_output"] = value if isinstance(value, (str, list, dict, bool)) else repr(value)
