"""One generation request inside the CPU engine: its inputs, its growing outputs, how it ended.

The scheduler's worker thread is the only writer. It appends a token's logprob before its id, then
calls `notify`, which hands the output length so far to the server's event loop (thread-safe): on
every token for streaming requests, otherwise once when the request ends. Readers slice the lists
to the length they were told, so they never see a token without its logprob. `error` (status,
message) is set when a request is refused or fails inside the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .sampling import RequestSampling

#: Called from the worker thread after each change: (output length so far, finished?).
Notifier = Callable[[int, bool], None]


@dataclass(eq=False)  # identity semantics: two requests are never 'equal'
class Request:
    rid: str
    input_ids: list[int]
    sampling: RequestSampling
    generator: torch.Generator
    #: With `n > 1` each sample is its own request `f"{rid}_{uuid}"`; the rid the client gave (its
    #: logical rid) aborts them all, as SGLang's `logical_rid_to_child_rids` does.
    parent_rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    #: max_new_tokens as SGLang's scheduler caps it (context_length - 2 - input length at most).
    max_new_tokens: int = 128
    notifier: Notifier | None = None
    #: Streaming clients are told about every token; others only when the request ends (waking the
    #: event loop per token would cost GIL time the decode loop needs).
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    finish_reason: dict[str, Any] | None = None
    error: tuple[int, str] | None = None
    weight_version: str = "default"
    created: float = field(default_factory=time.monotonic)
    #: When it last joined the waiting queue (a preempted request rejoins): the tie-break of preemption.
    queued: float = field(default_factory=time.monotonic)
    #: SGLang's request `priority` (used under --enable-priority-scheduling; see `priority.py`).
    priority: int | None = None
    finished_at: float | None = None
    num_retractions: int = 0
    #: A response for it went out (SGLang stamps `response_sent_to_client_ts` on the first one only).
    response_sent: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def all_tokens(self) -> list[int]:
        return self.input_ids + self.output_ids

    def append(self, token_id: int, logprob: float, top: list[tuple[float, int]] | None) -> None:
        self.output_logprobs.append(logprob)
        if self.top_logprobs_num > 0:
            self.output_top_logprobs.append(top or [])
        # ids last: a reader that sees n ids also sees n logprobs.
        self.output_ids.append(token_id)

    def banned_tokens(self, eos_token_ids: list[int]) -> list[int]:
        """Ids it may not sample next: EOS (unless ignored) and its stop ids while under min_new_tokens."""
        if len(self.output_ids) >= self.sampling.min_new_tokens:
            return []
        eos = [] if self.sampling.ignore_eos else eos_token_ids
        return [*eos, *self.sampling.stop_token_ids]

    def stop_reason(self, eos_token_ids: list[int]) -> dict[str, Any] | None:
        """Its finish reason after the token just appended, or None to go on."""
        # Same order as SGLang's Req.check_finished: length first, then stop tokens / EOS. Like
        # sglang 0.5.17 (_check_token_based_finish returns early, seen on the H200), ignore_eos
        # disables every token-based stop, stop_token_ids included.
        if len(self.output_ids) >= self.max_new_tokens:
            return {"type": "length", "length": len(self.output_ids)}
        if self.sampling.ignore_eos:
            return None
        last = self.output_ids[-1]
        if last in self.sampling.stop_token_ids or last in eos_token_ids:
            return {"type": "stop", "matched": last}
        return None

    def finish(self, reason: dict[str, Any]) -> None:
        if self.finished:
            return
        self.finish_reason = reason
        self.finished_at = time.monotonic()
        self.notify()

    def fail(self, status: int, message: str) -> None:
        if self.finished:
            return
        self.error = (status, message)
        self.finished_at = time.monotonic()
        self.notify()

    def notify(self) -> None:
        if self.notifier is not None and (self.stream or self.finished):
            self.notifier(len(self.output_ids), self.finished)

    def e2e_latency(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.created
