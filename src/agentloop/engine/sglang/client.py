"""The SGLang HTTP client: `EngineClient` over aiohttp, for real `sglang.launch_server` and the CPU engine.

Owns the wire protocol of one server: endpoint paths, request bodies and response shapes exactly as
SGLang 0.5.17 speaks them (see the recorded responses in
`tests/fixtures/sglang_http_samples.json` and `docs/gpu.md`):

- `/release_memory_occupation`, `/resume_memory_occupation` answer 200 with body `null`;
  `/abort_request` answers an empty 200; `/flush_cache` answers text (400 while requests run, which
  `flush_cache()` reports as False so the lifecycle can retry); weight updates answer
  `{"success", "message"}` where `success: false` (HTTP 400) raises.
- SGLang's error bodies, in any of their shapes, become an `EngineError` carrying the endpoint, status
  and the server's message (`error_body.py`).

How requests travel (one session, timeouts, which failures are retried, the keep-alive race) is
`transport.py`, the base class of `SGLangClient`.

What the client checks before sending (out-of-vocabulary ids, tensor names and shapes) and how it
learns about the served model is in `served_model.py`.

Tensor weight updates pick their transport from the server: the CPU engine's `/server_info` says
`"tensor_transport": "safetensors"` and gets base64 safetensors bytes (no pickle on the network);
real SGLang gets its own `MultiprocessingSerializer` payloads (CUDA IPC handles; one per TP rank,
like `Engine._serialize_tensors_per_rank`), imported lazily so this module needs no sglang.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable, Literal, Mapping, Sequence

import aiohttp
import anyio

from .. import wire_json
from ..base import (
    MEMORY_TAGS,
    EngineError,
    GenerateOutput,
    PauseMode,
    SamplingParams,
    parse_generate_response,
)
from ..memory_mark import served_version
from ..served_model import ServedModel, TensorTransport
from ..weight_payloads import NonFiniteWeightsError, check_finite, cuda_ipc_payloads, safetensors_payload
from .error_body import error_message
from .transport import DEFAULT_KEEPALIVE_SECONDS, HttpTransport

log = logging.getLogger(__name__)


class SGLangClient(HttpTransport):
    """Async client of one SGLang-compatible HTTP server (real SGLang or `agentloop serve`).

    `timeout` bounds every control call; `generate_timeout` bounds a generate unless the call gives
    its own. `retries`/`backoff` apply only to safe-to-repeat requests (see `transport.py`).
    `tensor_transport="auto"` asks `/server_info` once which weight-tensor transport to use.
    `keepalive_timeout`: seconds an idle pooled connection is reused (keep it below the server's,
    `SGLANG_KEEPALIVE_SECONDS`). A caller's own `session` keeps its connector's settings, and without
    our reuse-aware connector only connect failures are retried on it.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 60.0,
        generate_timeout: float = 900.0,
        session: aiohttp.ClientSession | None = None,
        tensor_transport: TensorTransport = "auto",
        retries: int = 3,
        backoff: float = 0.2,
        max_connections: int = 2048,
        keepalive_timeout: float = DEFAULT_KEEPALIVE_SECONDS,
        vocab_size: int | None | Literal["auto"] = "auto",
        weight_check: bool = True,
        check_finite_weights: bool = True,
    ) -> None:
        super().__init__(url, timeout=timeout, session=session, retries=retries, backoff=backoff,
                         max_connections=max_connections, keepalive_timeout=keepalive_timeout)
        self.generate_timeout = generate_timeout
        #: Set by the gate watching this client (`watch_gate`, `engine.gate.GateWatched`): whether
        #: generation is allowed now (AWAKE). A generate or /health whose request leaves while it says no
        #: is counted in `sent_outside_awake` — measured at the send, after any lookup the call awaited,
        #: not where the gate was passed.
        self.gate_open: Callable[[], bool] | None = None
        self.sent_outside_awake = 0
        #: What this client knows of the served model (vocabulary, parameter shapes, transport, TP size).
        self.served = ServedModel(self.url, self.server_info, self.model_info, tensor_transport=tensor_transport,
                                  vocab_size=vocab_size, weight_check=weight_check)
        #: Refuse NaN/Inf tensor updates before sending (`weight_payloads.check_finite`; cost in its docstring).
        self.check_finite_weights = check_finite_weights

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    async def prepare(self) -> None:
        """Look up the served model's facts now (see `ServedModel.prepare`), e.g. while starting up."""
        await self.served.prepare()

    def watch_gate(self, is_open: Callable[[], bool]) -> None:
        """`engine.gate.GateWatched`: count what this client sends while `is_open()` says no."""
        self.gate_open = is_open

    def _sending_generation(self, endpoint: str) -> None:
        if self.gate_open is not None and not self.gate_open():
            self.sent_outside_awake += 1
            log.error("%s sent to %s outside AWAKE (real SGLang crashes on a generate or /health while its "
                      "memory is released)", endpoint, self.url)

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any],
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        timeout: float | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        priority: int | None = None,
    ) -> GenerateOutput:
        """One generate. `sampling_params` may be a plain SGLang dict (`seed` is read as
        `sampling_seed`); `logprob_start_len` / `top_logprobs_num` are sent only when given (the
        prompt's logprobs and the top-k lists then sit in `GenerateOutput.raw_meta`); so is `priority`
        (SGLang's request priority, used by a server launched with --enable-priority-scheduling)."""
        if not isinstance(sampling_params, SamplingParams):
            if not isinstance(sampling_params, Mapping):
                raise TypeError(f"sampling_params must be SamplingParams or a mapping, got {type(sampling_params).__name__}")
            sampling_params = SamplingParams.from_mapping(sampling_params)
        # A rid is always sent so every request can be aborted by id.
        rid = rid or uuid.uuid4().hex
        vocab = await self.served.resolve_vocab_size()
        # The ids are the whole context, on every turn: encoded, converted and checked in C. No await
        # from here to the send, so what is checked is what is sent.
        ids_json = wire_json.int_list(input_ids)
        ids = input_ids if ids_json is not None else list(map(int, input_ids))
        if vocab is not None and ids and (min(ids) < 0 or max(ids) >= vocab):
            i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise EngineError("/generate", None, f"refused before sending: input_ids[{i}]={t} is out of "
                              f"vocabulary [0, {vocab}) (request {rid})", url=self.url)
        body: dict[str, Any] = {
            "sampling_params": sampling_params.to_json(),
            "return_logprob": bool(return_logprob),
            "rid": rid,
        }
        if logprob_start_len is not None:
            body["logprob_start_len"] = int(logprob_start_len)
        if top_logprobs_num is not None:
            body["top_logprobs_num"] = int(top_logprobs_num)
        if priority is not None:
            body["priority"] = int(priority)
        payload = wire_json.generate_body(ids_json if ids_json is not None else ids, body)
        self._sending_generation("/generate")
        out = await self._json("POST", "/generate", payload,
                               timeout=timeout if timeout is not None else self.generate_timeout, retry=False)
        if not isinstance(out, dict):
            raise EngineError("/generate", 200, f"expected one JSON object, got {type(out).__name__}", url=self.url)
        if "error" in out and "output_ids" not in out:
            raise EngineError("/generate", 200, error_message(json.dumps(out)), url=self.url)
        return parse_generate_response(out, rid=rid, server_url=self.url)

    # ------------------------------------------------------------------ memory
    @staticmethod
    def _tags_body(endpoint: str, tags: Sequence[str] | None) -> dict[str, Any]:
        # SGLang 0.5.17 accepts any tag on release (and then fails later, in its scheduler): refuse
        # unknown ones here, before anything is sent.
        if tags is None:
            return {}
        if isinstance(tags, str):
            raise ValueError(f"{endpoint}: tags must be a list of tags, not the string {tags!r}")
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise ValueError(f"{endpoint}: unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
        return {"tags": list(tags)}

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self._request("POST", "/release_memory_occupation", self._tags_body("/release_memory_occupation", tags))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self._request("POST", "/resume_memory_occupation", self._tags_body("/resume_memory_occupation", tags))

    # ------------------------------------------------------------------ weights
    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": str(model_path), "flush_cache": flush_cache,
                                "abort_all_requests": abort_all_requests}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._success_call("/update_weights_from_disk", body)

    async def update_weights_from_tensor(
        self,
        named_tensors: Sequence[tuple[str, Any]],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        named = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        if self.check_finite_weights:
            try:
                await anyio.to_thread.run_sync(check_finite, named)
            except NonFiniteWeightsError as e:
                raise EngineError("/update_weights_from_tensor", None, f"refused before sending: {e}", url=self.url) from None
        transport = await self.served.resolve_tensor_transport()
        if transport == "safetensors":
            # Serializing a model's worth of tensors is CPU work: keep the event loop free.
            payloads = [await anyio.to_thread.run_sync(safetensors_payload, named)]
        else:
            # HF names are what sglang's load_weights maps (load_format None); other formats carry their own.
            if self.served.weight_check and load_format is None:
                await self.served.check_named_tensors(named)
            payloads = cuda_ipc_payloads(named, await self.served.resolved_tp_size())
        body: dict[str, Any] = {"serialized_named_tensors": payloads, "load_format": load_format,
                                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = weight_version
        # `named` (and with it every CUDA tensor the IPC handles point at) stays referenced until the
        # server has answered, i.e. until it has copied the values.
        return await self._success_call("/update_weights_from_tensor", body)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout: float | None = None,
    ) -> dict[str, Any]:
        return await self._success_call("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}, timeout=timeout)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                                "shapes": [list(map(int, s)) for s in shapes], "group_name": group_name,
                                "flush_cache": flush_cache, "load_format": load_format}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._success_call("/update_weights_from_distributed", body, timeout=timeout)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return await self._success_call("/destroy_weights_update_group", {"group_name": group_name})

    # ------------------------------------------------------------------ control
    async def flush_cache(self, timeout: float | None = None) -> bool:
        """True once flushed; False while the server is busy (SGLang answers 400 then). With
        `timeout` (seconds) the server itself waits up to that long for idle (`?timeout=`)."""
        endpoint = "/flush_cache" if not timeout else f"/flush_cache?timeout={float(timeout)}"
        call_timeout = None if not timeout else self.timeout + float(timeout)
        status, data = await self._request("POST", endpoint, None, ok_statuses=(200, 400), timeout=call_timeout)
        if status != 200:
            log.debug("flush_cache on %s refused (%s): %s", self.url, status, error_message(data))
        return status == 200

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort|retract|in_place, not {mode!r}")
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        if not rid and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        body: dict[str, Any] = {"abort_all": bool(abort_all)}
        if rid:
            body["rid"] = rid
        await self._request("POST", "/abort_request", body)

    async def health(self) -> bool:
        """GET /health (on SGLang this runs a 1-token generate: call only while AWAKE, via the lifecycle).

        503 (starting, or unhealthy) is False; a connection failure raises EngineUnavailable.
        """
        self._sending_generation("/health")
        status, _ = await self._request("GET", "/health", None, retry=False, ok_statuses=(200, 500, 502, 503, 504))
        return status == 200

    async def model_info(self) -> dict[str, Any]:
        out = await self._json("GET", "/model_info")
        if not isinstance(out, dict):
            raise EngineError("/model_info", 200, f"expected a JSON object, got {out!r:.200}", url=self.url)
        return out

    async def server_info(self) -> dict[str, Any]:
        out = await self._json("GET", "/server_info")
        if not isinstance(out, dict):
            raise EngineError("/server_info", 200, f"expected a JSON object, got {out!r:.200}", url=self.url)
        return out

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None:
        """POST /update_weight_version: set the served weight version string, nothing else (SGLang sets it
        in its HTTP process; safe in any memory state). SGLang's own default aborts every request: ours does not."""
        await self._success_call("/update_weight_version", {"new_version": str(new_version),
                                                              "abort_all_requests": bool(abort_all_requests)})

    async def weight_version(self) -> str:
        """The served weight version (`/model_info`; SGLang removed `/get_weight_version`), without the
        mark a lifecycle records in it (`agentloop.engine.memory_mark.MemoryMark`)."""
        return served_version(str((await self.model_info()).get("weight_version", "")))
