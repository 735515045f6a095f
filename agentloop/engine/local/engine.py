"""`LocalEngine`: the CPU reference engine behind the HTTP server, as async operations.

It wires the pieces (model runner, memory manager, scheduler) together, validates requests into
`Request` objects, and runs every state change on the scheduler's worker thread via
`Scheduler.call`, awaiting the result from the event loop, so the aiohttp loop never blocks on a
forward pass. Slow preparation that touches no engine state (reading safetensors from disk,
base64-decoding tensor payloads) runs in a helper thread first. Errors meant for the client are
`EngineInputError` (HTTP 4xx/503 with a message); the server maps them.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch

from . import weights as weight_io
from .memory import MemoryManager, MemoryTagError, normalize_tags
from .model_runner import ModelRunner
from .request import Notifier, Request
from .sampling import RequestSampling, SamplingParamsError
from .scheduler import PAUSE_MODES, Scheduler


class EngineInputError(ValueError):
    """A request the engine refuses; `status` is the HTTP status the server answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class LocalEngine:
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
        )
        self.scheduler.weight_version = weight_version
        self.seed = seed
        self._counter = itertools.count()

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
    def new_request(
        self,
        input_ids: Any,
        sampling_params: Any,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        where: str = "input_ids",
    ) -> Request:
        """Validate one request's fields; raise EngineInputError naming the bad one."""
        if not isinstance(input_ids, list) or not input_ids:
            raise EngineInputError(f"{where} must be a non-empty list of token ids")
        for i, t in enumerate(input_ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise EngineInputError(f"{where}[{i}]={t!r} is not an integer token id")
            if not 0 <= t < self.vocab_size:
                raise EngineInputError(f"{where}[{i}]={t} is out of vocabulary (vocab_size {self.vocab_size})")
        if len(input_ids) >= self.context_length:
            raise EngineInputError(
                f"{where}: the input ({len(input_ids)} tokens) is longer than the model's context length ({self.context_length} tokens)"
            )
        try:
            sampling = RequestSampling.from_json(sampling_params, vocab_size=self.vocab_size)
        except SamplingParamsError as e:
            raise EngineInputError(str(e)) from None
        if rid is not None and not isinstance(rid, str):
            raise EngineInputError(f"rid must be a string, got {rid!r}")
        if not isinstance(return_logprob, bool):
            raise EngineInputError(f"return_logprob must be a boolean, got {return_logprob!r}")
        if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int) or logprob_start_len < -1:
            raise EngineInputError(f"logprob_start_len must be an integer >= -1, got {logprob_start_len!r}")
        if logprob_start_len >= len(input_ids):
            raise EngineInputError(f"logprob_start_len={logprob_start_len} must be < the input length {len(input_ids)}")
        if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise EngineInputError(f"top_logprobs_num must be an integer >= 0, got {top_logprobs_num!r}")
        seed = sampling.sampling_seed
        if seed is None:
            seed = self.seed * 1_000_003 + next(self._counter)
        gen = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        return Request(
            rid=rid or uuid.uuid4().hex,
            input_ids=list(input_ids),
            sampling=sampling,
            generator=gen,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            max_new_tokens=min(sampling.max_new_tokens, self.context_length - len(input_ids)),
        )

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

    async def flush_cache(self) -> bool:
        """True when flushed; False when requests are running or waiting (SGLang refuses then)."""

        def _flush() -> bool:
            if self.scheduler.busy():
                return False
            self.scheduler.kv.clear()
            return True

        return await self._on_worker(_flush)

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
            if "kv_cache" in tags:
                self.scheduler.kv.clear()
            return self.memory.release(tags)

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
        return await self._apply_weights(tensors, **kw)

    async def update_weights_from_tensor(self, payloads: Any, **kw: Any) -> str:
        tensors = await asyncio.to_thread(self._read, weight_io.read_tensor_payloads, payloads)
        return await self._apply_weights(tensors, **kw)

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
            if "weights" in self.memory.released:
                raise EngineInputError(
                    "weights are released; call /resume_memory_occupation with tags ['weights'] before updating them"
                )
            if abort_all_requests:
                self.scheduler.abort(None)
            try:
                n = weight_io.apply(self.runner.model, tensors)
            except weight_io.WeightUpdateError as e:
                raise EngineInputError(str(e)) from None
            self.memory.weights_valid = True
            if flush_cache and not self.scheduler.busy():
                self.scheduler.kv.clear()
            if weight_version is not None:
                self.scheduler.weight_version = weight_version
            return f"Success Weight version updated to {self.scheduler.weight_version}. ({n} tensors)"

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
