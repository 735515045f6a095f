"""The bookkeeping every agent loop shares: one `Episode` per trajectory.

It owns the `TokenBuffer`, the turn counters, metrics and timeline, the token budget (each turn's
`max_new_tokens` is clamped to what is left of the response budget and the context), the status and
finish reason, and the hand-off as a `Trajectory`. Loops (`single_turn`, `tool`, `replay`) only decide
what happens between model turns. A resumed sample (`sample.resume_from`, partial rollout) continues
from the earlier trajectory's tokens, turns, counters and metrics.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Any, Callable, Mapping, Sequence

from ..chat import TokenBuffer
from ..engine.base import GenerateOutput
from ..types import Sample, TimelineEvent, Trajectory, TrajectoryStatus
from .base import AgentContext, sample_seed

__all__ = ["Episode", "BudgetSpent", "MAX_PIECES_PER_TURN"]

#: Pieces one model turn may be cut into by weight updates before it ends aborted (and, in the
#: streaming mode, is resumed as a partial rollout): an engine that aborts everything must not loop.
MAX_PIECES_PER_TURN = 100


class BudgetSpent(Exception):
    """Internal signal: the token budget cannot take the next piece (carries the finish reason)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Episode:
    """State of one agent-loop run. Build with `Episode.start(...)`."""

    def __init__(self, sample: Sample, ctx: AgentContext, buffer: TokenBuffer | None) -> None:
        self.sample = sample
        self.ctx = ctx
        self.config = ctx.config
        self.buffer = buffer
        self.clock: Callable[[], float] = ctx.clock or time.monotonic
        self.assistant_turns = 0
        self.user_turns = 0
        self.tool_calls = 0
        self.metrics: dict[str, float] = {
            "generate_seconds": 0.0,
            "tool_seconds": 0.0,
            "tool_errors": 0.0,
            "tool_calls": 0.0,
        }
        self.timeline: list[TimelineEvent] = []
        self.turn_rewards: list[float] = []
        self.status: TrajectoryStatus = "completed"
        self.finish_reason = ""
        self.error: str | None = None
        self.extra: dict[str, Any] = {}
        self.started = self.clock()
        self._continued = False  # the last model turn continued an open (resumed) message
        self._sampled_nothing = False
        #: The `SamplingParams` of a model turn (`config.turn_sampling()`), built once per episode; each turn
        #: takes a copy with its own budget and seed.
        self.sampling = ctx.config.turn_sampling()

    # ------------------------------------------------------------------ construction
    @classmethod
    def start(
        cls,
        sample: Sample,
        ctx: AgentContext,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        prompt_ids: Sequence[int] | None = None,
    ) -> "Episode":
        """A fresh episode from the sample's prompt, or a continuation of `sample.resume_from`."""
        kwargs = ctx.config.chat_template_kwargs
        old = sample.resume_from
        if old is not None:
            buf = TokenBuffer.from_trajectory(old, ctx.tokenizer, tools, chat_template_kwargs=kwargs)
            ep = cls(sample, ctx, buf)
            ep.assistant_turns = int(old.extra.get("assistant_turns", old.num_turns))
            ep.user_turns = int(old.extra.get("user_turns", 0))
            ep.tool_calls = old.tool_calls
            for k, v in old.metrics.items():
                ep.metrics[k] = float(v)
            ep.timeline = list(old.timeline)
            ep.turn_rewards = list(old.turn_rewards)
            ep.extra = {k: v for k, v in old.extra.items() if k not in ("traceback", "assistant_turns", "user_turns")}
            ep.metrics["resumed"] = ep.metrics.get("resumed", 0.0) + 1.0
            return ep
        buf = TokenBuffer(ctx.tokenizer, sample.messages, tools, prompt_ids=prompt_ids, chat_template_kwargs=kwargs)
        return cls(sample, ctx, buf)

    @classmethod
    def failed_before_start(cls, sample: Sample, ctx: AgentContext, exc: BaseException) -> Trajectory:
        """The trajectory of a sample whose prompt could not even be built (bad messages, template)."""
        ep = cls(sample, ctx, None)
        ep.fail(exc)
        return ep.trajectory()

    # ------------------------------------------------------------------ budget
    def remaining(self) -> int:
        assert self.buffer is not None
        return self.buffer.remaining(self.config.max_response_tokens, self.config.max_context_tokens)

    def _budget_reason(self, need: int = 1) -> str:
        assert self.buffer is not None
        if self.config.max_response_tokens - self.buffer.response_len < need:
            return "max_response_tokens"
        return "max_context_tokens"

    def check_fits(self, n: int) -> None:
        """Raise `BudgetSpent` if `n` more tokens do not fit."""
        if n > self.remaining():
            raise BudgetSpent(self._budget_reason(n))

    # ------------------------------------------------------------------ model turns
    async def generate(self, *, max_new_tokens: int | None = None, **overrides: Any) -> GenerateOutput:
        """One model turn through `ctx.generate`; appends its tokens verbatim. Raises `BudgetSpent`
        when no token fits. The turn's `max_new_tokens` is the smallest of the per-turn limit, the
        requested one and what the budget has left.

        A request aborted because the engines were drained for a weight update
        (`GenerateOutput.interrupted_for_update`, the streaming mode's in-flight update) does not end
        the turn: what it sampled is recorded as a piece of the turn (its own version and logprobs),
        and the rest of the turn is requested again (it waits at the gate for the new weights),
        exactly as a resumed partial rollout would continue it, without ending the trajectory. The
        output returned then covers the whole turn (the pieces' tokens and logprobs in order; its
        `weight_version` is the last piece's, the buffer's turns keep each piece's)."""
        assert self.buffer is not None
        start_open = len(self.buffer.open_turn_ids)
        continuing = start_open > 0
        pieces: list[GenerateOutput] = []
        for _ in range(MAX_PIECES_PER_TURN):
            left = self.remaining()
            if left <= 0:
                if pieces:  # an interrupted piece used the rest of the budget
                    break
                raise BudgetSpent(self._budget_reason())
            open_len = len(self.buffer.open_turn_ids)
            if max_new_tokens is None:
                # The per-turn limit is per assistant message: a resumed one has used part of it.
                want = max(1, self.config.max_new_tokens_per_turn - open_len)
            else:
                want = max(1, max_new_tokens - (open_len - start_open))
            n = min(want, left)
            params = self.sampling.replace(max_new_tokens=n, **overrides)
            if params.sampling_seed is not None and "sampling_seed" not in overrides:
                s = self.sample
                # Per sample and turn (group members would otherwise draw identical tokens); the turn
                # count comes from the buffer, so a resumed trajectory goes on where it stopped.
                params.sampling_seed = sample_seed(params.sampling_seed, s.group_id or s.uid, s.index_in_group,
                                                   len(self.buffer.turns))
            t0 = self.clock()
            out = await self.ctx.generate(self.buffer.ids, params)
            t1 = self.clock()
            self.timeline.append(TimelineEvent("generate", t0, t1))
            self.metrics["generate_seconds"] += t1 - t0
            if out.aborted and out.interrupted_for_update and len(out.output_ids) >= n:
                # Every token asked for was sampled before the abort landed: the request ended by
                # its length, not cut (a resume would sample one token more than the turn wants).
                out.finish_reason = {"type": "length", "length": len(out.output_ids)}
                out.interrupted_for_update = False
            if out.output_ids or not out.aborted:
                self.buffer.append_model_turn(out, generate_seconds=t1 - t0)
                pieces.append(out)
            if not (out.aborted and out.interrupted_for_update):
                break
            self.metrics["interrupted_for_update"] = self.metrics.get("interrupted_for_update", 0.0) + 1.0
        out = _whole_turn(pieces, out)
        self._continued = continuing
        self._sampled_nothing = not out.output_ids
        if out.aborted and not out.output_ids:
            # Aborted (or never dispatched) before its first token: no turn to record; a resume
            # starts this turn afresh.
            return out
        if not continuing:
            self.assistant_turns += 1
        if out.finish_type == "length" and n < want and len(out.output_ids) >= n:
            # Cut by the budget rather than the per-turn limit: say which budget.
            self.extra["turn_cut_by"] = self._budget_reason()
        else:
            self.extra.pop("turn_cut_by", None)
        return out

    def show_assistant(self, message: Mapping[str, Any]) -> None:
        """Record the readable form of the assistant message just sampled; a continuation of a
        resumed (aborted) message replaces that message's earlier, partial form."""
        assert self.buffer is not None
        if self._sampled_nothing and not self._continued:
            return
        self.buffer.add_display_message(message, replace_last=self._continued)

    def turn_text(self) -> str:
        """Text of the assistant message just sampled (across a resumed continuation), for parsing
        only: trailing stop/EOS tokens are left out; the tokens themselves are never re-encoded."""
        assert self.buffer is not None
        ids = list(self.buffer.open_turn_ids)
        stops = self._stop_ids()
        while ids and ids[-1] in stops:
            ids.pop()
        return self.buffer.decode(ids)

    def _stop_ids(self) -> set[int]:
        stops: set[int] = set(self.sampling.stop_token_ids or [])
        tok = self.ctx.tokenizer
        eos = getattr(tok, "eos_token_id", None) if tok is not None else None
        if isinstance(eos, int):
            stops.add(eos)
        if self.buffer is not None and self.buffer.turns:
            matched = self.buffer.turns[-1].finish_reason.get("matched")
            if isinstance(matched, int):
                stops.add(matched)
        return stops

    # ------------------------------------------------------------------ other turns
    def append_messages(
        self, messages: Sequence[Mapping[str, Any]], *, shown: Sequence[Mapping[str, Any]] | None = None
    ) -> None:
        """Append tool/user messages as a template delta (mask 0) if they fit; else `BudgetSpent`.
        A delta must also leave room for at least one generated token. `shown` (default `messages`)
        is what the readable record keeps, when it carries fields the tokens must not (tool_call_id)."""
        assert self.buffer is not None
        delta = self.buffer.delta_for(messages)
        self.check_fits(len(delta) + 1)
        self.buffer.append_messages(shown if shown is not None else messages, delta=delta)

    def event(self, kind: str, start: float, end: float) -> None:
        self.timeline.append(TimelineEvent(kind, start, end))

    # ------------------------------------------------------------------ ending
    def finish(self, status: TrajectoryStatus, reason: str) -> None:
        self.status = status
        self.finish_reason = reason

    def fail(self, exc: BaseException) -> None:
        self.status = "failed"
        self.finish_reason = "error"
        self.error = f"{type(exc).__name__}: {exc}"
        self.extra["traceback"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=8))

    def trajectory(self) -> Trajectory:
        s = self.sample
        self.metrics["tool_calls"] = float(self.tool_calls)
        self.metrics["wall_seconds"] = self.metrics.get("wall_seconds", 0.0) + (self.clock() - self.started)
        common = dict(
            num_turns=self.assistant_turns,
            tool_calls=self.tool_calls,
            error=self.error,
            metrics=dict(self.metrics),
            timeline=list(self.timeline),
            turn_rewards=list(self.turn_rewards),
            extra={**self.extra, "assistant_turns": self.assistant_turns, "user_turns": self.user_turns},
            index_in_group=s.index_in_group,
        )
        if self.buffer is None:
            return Trajectory(
                uid=s.uid, group_id=s.group_id, prompt_ids=[], status=self.status,
                finish_reason=self.finish_reason, messages=[dict(m) for m in s.messages], **common,
            )
        self.metrics["prompt_tokens"] = float(len(self.buffer.prompt_ids))
        self.metrics["response_tokens"] = float(self.buffer.response_len)
        common["metrics"] = dict(self.metrics)
        return self.buffer.to_trajectory(
            s.uid, s.group_id, status=self.status, finish_reason=self.finish_reason, **common
        )


def _whole_turn(pieces: list[GenerateOutput], last: GenerateOutput) -> GenerateOutput:
    """The output an agent sees for a turn sampled in `pieces` (one piece: itself)."""
    if len(pieces) <= 1:
        return pieces[0] if pieces else last
    end = pieces[-1]
    return dataclasses.replace(
        end, output_ids=[t for p in pieces for t in p.output_ids],
        output_logprobs=[lp for p in pieces for lp in p.output_logprobs],
        completion_tokens=sum(p.completion_tokens for p in pieces), interrupted_for_update=False)
