"""Continuous batching for the CPU engine: the worker thread that admits, prefills and decodes.

Why not transformers' own continuous batching (`ContinuousBatchingManager`, transformers 5.24,
evaluated first)? It batches well and can cancel, but: greedy vs sampling is fixed per manager and
sampling draws from the global RNG (no per-request seeds, so no reproducible rollouts); its logprobs
are taken after top-k/top-p truncation (not SGLang's temperature-scaled, untruncated ones), with no
top or prompt logprobs; it has no min_new_tokens and no pause that keeps or retracts requests; and
its KV cache can only be released by destroying the manager. So this is a small loop of our own on
transformers' model forward and `DynamicCache`.

Each iteration of the worker thread: run queued control commands (submit, abort, pause, memory,
weight updates — they all execute here, between forward passes, so they never race a forward);
then, unless paused or memory is released, admit waiting requests up to `max_running_requests`
(prefilled together in one left-padded forward of at most `max_prefill_tokens` padded tokens; each
samples its first token), and run ONE decode step for every running
request together (`ModelRunner.decode` over the left-padded `BatchKV`). New requests therefore
join the next decode step of a batch already in flight — continuous batching. A step of 16 rows
costs about 4.4x a step of one (13.6 vs 3.1 ms, hidden 256 x 4 layers, 2 cores), so throughput rises
~3.6x from 1 to 16 concurrent requests (benchmarks/results/cpu_engine_batching.json).

Pause modes follow SGLang: `abort` finishes every queued and running request as aborted; `retract`
drops running requests' KV and puts them back at the head of the queue (re-prefilled from prompt +
tokens so far on continue); `in_place` just stops stepping. Requests arriving while paused are
held outside the scheduler (like SGLang's tokenizer manager does), so the scheduler can be idle for
flush/release while they wait for `continue_generation`.

With `--enable-priority-scheduling` the queue is admitted by priority and a full batch preempts
lower-priority running requests, as SGLang's scheduler does (`priority.py`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from .kv_cache import BatchKV
from .memory import MemoryManager
from .model_runner import ModelRunner
from .priority import PriorityPolicy
from .request import Request
from .sampling import input_logprobs, sample_next

log = logging.getLogger(__name__)
T = TypeVar("T")

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class SchedulerStats:
    """Counters exposed in /server_info (tests use max_batch_size_seen to prove batching)."""

    max_batch_size_seen: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    prefills: int = 0
    prefill_batches: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    retracted_requests: int = 0
    #: Running requests put back in the queue for better-priority ones (priority scheduling).
    preempted_requests: int = 0
    #: Wall seconds the worker spent in prefill/decode steps (benchmarks: tokens per busy second).
    busy_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["mean_decode_batch_size"] = round(self.decode_rows / self.decode_steps, 3) if self.decode_steps else 0.0
        d["busy_seconds"] = round(self.busy_seconds, 4)
        return d


class Scheduler:
    """Owns the request queues, the running batch and its KV cache, and the worker thread."""

    def __init__(
        self,
        runner: ModelRunner,
        memory: MemoryManager,
        *,
        max_running_requests: int = 64,
        context_length: int | None = None,
        original_logprob: bool = False,
        max_prefill_tokens: int = 8192,
        priority: PriorityPolicy | None = None,
    ) -> None:
        self.runner = runner
        self.priority = priority or PriorityPolicy()
        self.max_prefill_tokens = max_prefill_tokens
        self.memory = memory
        self.max_running_requests = max_running_requests
        self.context_length = context_length or runner.context_length
        self.original_logprob = original_logprob
        self.weight_version = "default"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: deque[Request] = deque()  # arrived while paused
        self.kv = BatchKV()
        self.paused = False
        self.stats = SchedulerStats()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="agentloop-cpu-engine", daemon=True)

    # ---- thread-safe entry points ---------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[[], T]) -> "concurrent.futures.Future[T]":
        """Run `fn` on the worker thread between forward passes; returns a Future of its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stop.is_set() or not self._thread.is_alive():
            # Nobody would ever run it: fail now instead of leaving the caller waiting forever.
            fut.set_exception(RuntimeError("the engine's worker thread is not running (server shutting down?)"))
            return fut
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    # ---- called on the worker thread (through `call`) ------------------------------------
    def submit(self, req: Request) -> None:
        block = self.memory.generation_block_reason()
        if block is not None:
            req.fail(503, block)
            return
        if req.priority is not None and not self.priority.enabled and self.priority.abort_when_disabled:
            req.fail(503, "Using priority is disabled for this server. Please send a new request without a priority.")
            return
        req.weight_version = self.weight_version
        if self.paused:
            self.held.append(req)
        else:
            req.queued = time.monotonic()
            self.waiting.append(req)

    def find(self, rid: str) -> Request | None:
        for r in (*self.running, *self.waiting, *self.held):
            if r.rid == rid:
                return r
        return None

    def abort(self, rid: str | None = None, message: str = "Aborted") -> int:
        """Abort one request by rid (or the samples of an `n > 1` request by its rid), or all when rid
        is None. Returns how many were aborted."""
        victims = [r for r in (*self.running, *self.waiting, *self.held)
                   if rid is None or r.rid == rid or (r.parent_rid is not None and r.parent_rid == rid)]
        for r in victims:
            # SGLang's abort reason carries status_code/err_type (null for a plain abort).
            self._finish(r, {"type": "abort", "message": message, "status_code": None, "err_type": None})
        self.waiting = deque(r for r in self.waiting if not r.finished)
        self.held = deque(r for r in self.held if not r.finished)
        self._drop_finished_rows()
        self.stats.aborted_requests += len(victims)
        return len(victims)

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self.paused = True
        if mode == "abort":
            self.abort(None)
        elif mode == "retract":
            self.retract_all()

    def resume_generation(self) -> None:
        self.paused = False
        while self.held:
            self.submit(self.held.popleft())

    def retract_all(self) -> None:
        """Drop running requests' KV; requeue them first in line, generated tokens kept."""
        for r in reversed(self.running):
            r.num_retractions += 1
            self.waiting.appendleft(r)
        self.stats.retracted_requests += len(self.running)
        self.running = []
        self.kv.clear()

    def busy(self) -> bool:
        """Requests the scheduler owns (running or queued); held ones are not the scheduler's yet."""
        return bool(self.running or self.waiting)

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._run_commands()
            if self._can_step():
                t0 = time.perf_counter()
                try:
                    self._step()
                except Exception as e:  # a failed forward must not kill the server
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    for r in self.running:
                        r.fail(500, f"engine step failed: {type(e).__name__}: {e}")
                    self.running = []
                    self.kv.clear()
                finally:
                    self.stats.busy_seconds += time.perf_counter() - t0
            else:
                self._wake.wait(0.5)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)

    def _can_step(self) -> bool:
        if self.paused or self.memory.generation_block_reason() is not None:
            return False
        return bool(self.running or self.waiting)

    def _step(self) -> None:
        self._admit()
        if not self.running:
            return
        rows = self.running
        logits = self.runner.decode(self.kv, [r.output_ids[-1] for r in rows])
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(rows)
        self.stats.max_batch_size_seen = max(self.stats.max_batch_size_seen, len(rows))
        self._sample_into(rows, logits)
        self._drop_finished_rows()

    def _admit(self) -> None:
        """Prefill waiting requests (together, within the token budget) and add them to the batch."""
        if self.priority.enabled and self.waiting:
            self.waiting = deque(self.priority.order(self.waiting))
            self._preempt_for_waiting()
        group: list[Request] = []
        longest = 0
        while self.waiting and len(self.running) + len(group) < self.max_running_requests:
            req = self.waiting[0]
            if req.finished:
                self.waiting.popleft()
                continue
            n = len(req.all_tokens)
            # Padded size of the group's forward; one request alone may exceed the budget.
            if group and max(longest, n) * (len(group) + 1) > self.max_prefill_tokens:
                break
            group.append(self.waiting.popleft())
            longest = max(longest, n)
        if not group:
            return
        try:
            self._prefill(group)
        except Exception as e:  # these requests fail; the running batch and the server go on
            log.error("prefill of %s failed:\n%s", [r.rid for r in group], traceback.format_exc())
            for r in group:
                if not any(r is x for x in self.running):
                    r.fail(500, f"prefill failed: {type(e).__name__}: {e}")

    def _preempt_for_waiting(self) -> None:
        """A full batch makes room for better-priority waiting requests: the preempted ones rejoin the
        queue with their tokens (re-prefilled when admitted again, like a retraction)."""
        free = self.max_running_requests - len(self.running)
        preempted: list[Request] = []
        for cand in self.waiting:
            if cand.finished:
                continue
            if free > 0:
                free -= 1
                continue
            out = self.priority.victims(cand, [r for r in self.running if not any(r is p for p in preempted)], 1)
            if not out:
                break
            preempted += out
        if not preempted:
            return
        gone = {id(r) for r in preempted}
        keep = [i for i, r in enumerate(self.running) if id(r) not in gone]
        self.running = [self.running[i] for i in keep]
        self.kv.keep(keep)
        now = time.monotonic()
        for r in preempted:
            r.num_retractions += 1
            r.queued = now
        self.stats.preempted_requests += len(preempted)
        self.waiting = deque(self.priority.order([*self.waiting, *preempted]))

    def _prefill(self, group: list[Request]) -> None:
        """One padded forward over the group's known tokens; sample each one's next token."""
        fed = [r.all_tokens for r in group]  # prompt, plus tokens generated before a retraction
        want_lp = [r.return_logprob and r.logprob_start_len >= 0 and r.input_token_logprobs is None for r in group]
        logits, cache, mask = self.runner.prefill_batch(fed, all_logits=any(want_lp))
        self.stats.prefills += len(group)
        self.stats.prefill_batches += 1
        for i, r in enumerate(group):
            if want_lp[i]:
                r.input_token_logprobs, r.input_top_logprobs = input_logprobs(
                    logits[i, logits.shape[1] - len(fed[i]):], r.input_ids, r.logprob_start_len, r.sampling,
                    r.top_logprobs_num, original_logprob=self.original_logprob)
        last = logits[:, -1]
        rows = [i for i, r in enumerate(group) if r.max_new_tokens > 0]
        for i, r in enumerate(group):
            if r.max_new_tokens <= 0:  # scoring only (max_new_tokens=0): SGLang returns no tokens
                self._finish(r, {"type": "length", "length": 0})
        if rows:
            self._sample_into([group[i] for i in rows], last[rows])
        keep = [i for i in rows if not group[i].finished]
        if keep:
            # The cache covers `fed`; each token just sampled is fed by the next decode step.
            block = BatchKV.from_cache(cache, mask)
            block.keep(keep)
            self.kv.merge(block)
            self.running.extend(group[i] for i in keep)

    def _sample_into(self, rows: list[Request], logits: Any) -> None:
        eos = self.runner.eos_token_ids
        banned = [r.banned_tokens(eos) for r in rows]
        samples = sample_next(
            logits,
            [r.sampling for r in rows],
            [r.generator for r in rows],
            top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else 0 for r in rows],
            banned=banned,
            outputs=[r.output_ids for r in rows],
            original_logprob=self.original_logprob,
        )
        for r, s in zip(rows, samples):
            r.append(s.token_id, s.logprob, s.top)
            self.stats.generated_tokens += 1
            reason = r.stop_reason(eos)
            if reason is not None:
                self._finish(r, reason)
            else:
                r.notify()

    def _finish(self, r: Request, reason: dict[str, Any]) -> None:
        r.weight_version = self.weight_version
        r.finish(reason)
        self.stats.finished_requests += 1

    def _drop_finished_rows(self) -> None:
        keep = [i for i, r in enumerate(self.running) if not r.finished]
        if len(keep) != len(self.running):
            self.running = [self.running[i] for i in keep]
            self.kv.keep(keep)
