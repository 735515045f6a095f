"""`LocalEngine`: the CPU reference engine behind the HTTP server, as async operations.

It wires the pieces (model runner, memory manager, scheduler) together, has requests validated into
`Request` objects (`admission`), and runs every state change on the scheduler's worker thread via
`Scheduler.call`, awaiting the result from the event loop, so the aiohttp loop never blocks on a
forward pass. Slow preparation that touches no engine state (reading safetensors from disk,
base64-decoding tensor payloads) runs in a helper thread first. Errors meant for the client are
`EngineInputError` (HTTP 4xx/503 with a message); the server maps them. Length rules and weight
updates follow SGLang: prompt + explicit max_new_tokens beyond the context is refused (no silent
clipping), and an update waits for the generates in flight (`update_lock.ModelUpdateLock`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from . import weights as weight_io
from .admission import EngineInputError, build_request
from .memory import SGLANG_WOULD_CRASH, MemoryManager, MemoryTagError, normalize_tags
from .model_runner import ModelRunner
from .priority import PriorityPolicy
from .request import Notifier, Request
from .scheduler import PAUSE_MODES, Scheduler
from .update_lock import ModelUpdateLock

__all__ = ["LocalEngine"]


log = logging.getLogger(__name__)


class LocalEngine:
    """The CPU engine's operations (generate, abort, pause, flush, memory, weights, stats) as coroutines."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_running_requests: int = 64,
        context_length: int | None = None,
        weight_version: str = "default",
        seed: int = 0,
        original_logprob: bool = False,
        num_threads: int | None = None,
        max_prefill_tokens: int = 8192,
        priority: PriorityPolicy | None = None,
    ) -> None:
        self.model_path = str(Path(model_dir))
        self.runner = ModelRunner(model_dir, num_threads=num_threads)
        self.memory = MemoryManager(self.runner.model)
        self.scheduler = Scheduler(
            self.runner,
            self.memory,
            max_running_requests=max_running_requests,
            context_length=context_length,
            original_logprob=original_logprob,
            max_prefill_tokens=max_prefill_tokens,
            priority=priority,
        )
        self.scheduler.weight_version = weight_version
        self.seed = seed
        self._counter = itertools.count()
        #: Generates hold it shared; weight updates exclusively (`ModelUpdateLock`).
        self.model_update_lock = ModelUpdateLock()
        self._flush_pending = False

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    @property
    def context_length(self) -> int:
        return self.scheduler.context_length

    async def _on_worker(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn))

    # ---- generation ------------------------------------------------------------------------
    def new_request(self, input_ids: Any, sampling_params: Any, **fields: Any) -> Request:
        """Validate one request against this engine (vocabulary, context length) and make it a `Request`;
        `fields` are `admission.build_request`'s (rid, return_logprob, logprob_start_len,
        top_logprobs_num, priority, where). Raises EngineInputError naming the bad field."""
        return build_request(input_ids, sampling_params, vocab_size=self.vocab_size,
                             context_length=self.context_length, default_seed=self._next_seed, **fields)

    def _next_seed(self) -> int:
        """The seed of a request that brings none: distinct per request, reproducible per engine seed."""
        return self.seed * 1_000_003 + next(self._counter)

    async def submit(self, req: Request, notifier: Notifier) -> None:
        """Queue `req`; `notifier` is called from the worker thread on every update."""
        req.notifier = notifier

        def _submit() -> None:
            if self.scheduler.find(req.rid) is not None:
                req.fail(400, f"rid {req.rid!r} is already in flight; rids must be unique")
                return
            self.scheduler.submit(req)

        await self._on_worker(_submit)

    async def abort(self, rid: str | None) -> int:
        return await self._on_worker(lambda: self.scheduler.abort(rid))

    # ---- control ---------------------------------------------------------------------------
    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise EngineInputError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        await self._on_worker(lambda: self.scheduler.pause(mode))

    async def continue_generation(self) -> None:
        await self._on_worker(self.scheduler.resume_generation)

    async def flush_cache(self, timeout_s: float = 0.0) -> tuple[bool, str]:
        """SGLang's flush (scheduler_components/flush_wrapper.py): (flushed?, message).

        Without a timeout it is refused at once while requests run or wait (message "": the server
        answers SGLang's "Flush cache failed."); with one it waits up to `timeout_s` for the
        scheduler to go idle. One deferred flush at a time, like SGLang.
        """

        def _flush() -> bool:
            if self.scheduler.busy():
                return False
            self.scheduler.kv.clear()
            return True

        if timeout_s <= 0:
            return await self._on_worker(_flush), ""
        if self._flush_pending:
            return False, "Another flush_cache is already in progress."
        self._flush_pending = True
        try:
            deadline = asyncio.get_running_loop().time() + timeout_s
            while not await self._on_worker(_flush):
                if asyncio.get_running_loop().time() >= deadline:
                    return False, "Timed out waiting for idle state."
                await asyncio.sleep(0.01)
            return True, ""
        finally:
            self._flush_pending = False

    async def release_memory(self, tags: Sequence[str] | None) -> list[str]:
        try:
            tags = normalize_tags(tags)
        except MemoryTagError as e:
            raise EngineInputError(str(e)) from None

        def _release() -> list[str]:
            if self.scheduler.running:
                raise EngineInputError(
                    f"cannot release memory while {len(self.scheduler.running)} request(s) are running; "
                    "pause_generation (abort or retract) or abort them first"
                )
            try:
                released = self.memory.release(tags)
            except MemoryTagError as e:
                raise EngineInputError(str(e)) from None
            if "kv_cache" in tags:
                self.scheduler.kv.clear()
            return released

        return await self._on_worker(_release)

    async def resume_memory(self, tags: Sequence[str] | None) -> list[str]:
        def _resume() -> list[str]:
            try:
                return self.memory.resume(tags)
            except MemoryTagError as e:
                raise EngineInputError(str(e)) from None

        return await self._on_worker(_resume)

    async def update_weights_from_disk(self, model_path: Any, **kw: Any) -> str:
        if not isinstance(model_path, str) or not model_path:
            raise EngineInputError("model_path must be a non-empty string (a safetensors file or HF folder)")
        tensors = await asyncio.to_thread(self._read, weight_io.read_disk, model_path)
        # sglang's model runner says this on a disk load; /model_info then names the new path
        # (TokenizerManager._update_model_path_info).
        msg = await self._apply_weights(tensors, base_message="Succeeded to update model weights.", **kw)
        self.model_path = model_path
        return msg

    async def update_weights_from_tensor(self, payloads: Any, **kw: Any) -> str:
        tensors = await asyncio.to_thread(self._read, weight_io.read_tensor_payloads, payloads)
        return await self._apply_weights(tensors, base_message="Success", **kw)

    async def update_weight_version(self, new_version: Any, *, abort_all_requests: bool = True) -> None:
        """SGLang's /update_weight_version: abort everything (by default), then record the version."""
        if not isinstance(new_version, str):
            raise EngineInputError(f"new_version must be a string, got {new_version!r}")
        if abort_all_requests:
            await self.abort(None)

        def _set() -> None:
            self.scheduler.weight_version = new_version

        await self._on_worker(_set)

    @staticmethod
    def _read(reader: Any, arg: Any) -> dict[str, torch.Tensor]:
        try:
            return reader(arg)
        except weight_io.WeightUpdateError as e:
            raise EngineInputError(str(e)) from None

    async def _apply_weights(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        base_message: str,
        load_format: Any = None,
        weight_version: Any = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> str:
        if load_format not in (None, "direct", "auto", "safetensors"):
            raise EngineInputError(f"load_format {load_format!r} is not supported by the CPU engine (use null or 'direct')")
        if weight_version is not None and not isinstance(weight_version, str):
            raise EngineInputError(f"weight_version must be a string, got {weight_version!r}")

        def _apply() -> str:
            if flush_cache and self.scheduler.paused and self.scheduler.busy():
                # SGLang asserts the flush after a weight load succeeds (scheduler_update_weights_mixin:
                # "Cache flush failed after updating weights"), and a flush fails while requests are
                # paused in place or retracted to its queue: that assert kills the scheduler.
                raise EngineInputError(
                    f"{SGLANG_WOULD_CRASH} (its flush after the weight load fails while {len(self.scheduler.running)} "
                    f"running and {len(self.scheduler.waiting)} queued request(s) are paused, and it asserts the flush "
                    "succeeded): send the update with flush_cache=false while generation is paused")
            if "weights" in self.memory.released:
                raise EngineInputError(
                    "weights are released; call /resume_memory_occupation with tags ['weights'] before updating them"
                )
            try:
                n = weight_io.apply(self.runner.model, tensors)
            except weight_io.WeightUpdateError as e:
                raise EngineInputError(str(e)) from None
            log.info("weight update: %d tensors loaded", n)
            self.memory.weights_valid = True
            if flush_cache and not self.scheduler.busy():
                self.scheduler.kv.clear()
            message = base_message
            if weight_version is not None:
                self.scheduler.weight_version = weight_version
                message += f" Weight version updated to {weight_version}."
            return message

        if abort_all_requests:
            await self.abort(None)
        # Like SGLang's tokenizer manager: paused -> update at once (the caller stopped generation on
        # purpose); otherwise wait for the generates in flight to end, holding new ones back.
        if self.scheduler.paused:
            return await self._on_worker(_apply)
        async with self.model_update_lock.writer():
            return await self._on_worker(_apply)

    # ---- introspection -----------------------------------------------------------------------
    async def stats(self) -> dict[str, Any]:
        def _stats() -> dict[str, Any]:
            s = self.scheduler
            return {
                **s.stats.as_dict(),
                "num_running": len(s.running),
                "num_waiting": len(s.waiting),
                "num_held": len(s.held),
                "paused": s.paused,
                "released_tags": sorted(self.memory.released),
                "weights_valid": self.memory.weights_valid,
                "weights_bytes": self.memory.weights_bytes(),
                "kv_cache_bytes": s.kv.nbytes(),
            }

        return await self._on_worker(_stats)
