"""The engine protocol: one async interface whose operations mirror SGLang's HTTP server API.

Everything above `agentloop.engine` talks to engines through `EngineClient`; the SGLang HTTP
client (`sglang/`) implements it, and because the CPU reference engine (`local/`) serves the same
HTTP endpoints, that one client drives both. Data types here are the request/response contracts
(field names follow SGLang's `io_struct.py` and the real responses recorded in
`tests/fixtures/sglang_http_samples.json`).

Nothing here may be called for generation directly by agent code: generation goes through
`agentloop.engine.lifecycle.Lifecycle`, whose gate guarantees the engine is AWAKE.
"""

from __future__ import annotations

import dataclasses
import functools
import urllib.parse
from dataclasses import InitVar, dataclass, field, fields
from operator import itemgetter
from typing import Any, Literal, Mapping, Protocol, Sequence, runtime_checkable

#: Memory tags SGLang understands for release/resume (`cuda_graph` since ~0.5.5).
MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")

PauseMode = Literal["abort", "retract", "in_place"]


def engine_url(url: str) -> str:
    """An engine server's base URL, as the client sends to it: `HOST:PORT` without a scheme means
    `http://HOST:PORT` (how SGLang prints its address); a trailing slash is dropped. Anything that is
    not an http(s) URL with a host raises ValueError saying what is wrong and what is expected."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"engine URL {url!r}: scheme {parts.scheme!r} is not http or https "
                         "(expected http://HOST:PORT)")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError(f"engine URL {url!r}: the port is not a number (expected http://HOST:PORT)") from None
    if not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"engine URL {url!r}: expected http://HOST:PORT (a host, an optional port and path)")
    return text.rstrip("/")


class EngineError(RuntimeError):
    """An engine call failed. Says which endpoint of which server, the HTTP status and the server's message."""

    def __init__(self, endpoint: str, status: int | None, message: str, *, url: str = "") -> None:
        self.endpoint = endpoint
        self.status = status
        self.message = message
        self.url = url
        where = f"{url}{endpoint}" if url else endpoint
        super().__init__(f"{where} failed (status {status}): {message}")


class EngineUnavailable(EngineError):
    """The server could not be reached (connection refused, reset, timeout): it may be dead."""


class NoServerError(EngineUnavailable):
    """No healthy engine server is left to route to."""


#: Why sglang < 0.5.19 answers with one logprob fewer than output ids (read in its output streamer; the
#: shape `MisalignedLogprobs.retract_off_by_one` recognises).
SGLANG_RETRACT_LOGPROB_BUG = (
    "sglang < 0.5.19 drops the first token's logprob of a request retracted before its first token (priority "
    "preemption, or decode retraction under KV-cache pressure, with overlap scheduling on); fixed in sglang 0.5.19 "
    "by PR #26510, avoided with --disable-overlap-schedule"
)


class MisalignedLogprobs(EngineError):
    """A `/generate` answer whose logprobs do not belong to its output ids. Nothing of it may reach a
    trajectory; the server itself is healthy, so a router asks again (the turn is sampled afresh).

    `retract_off_by_one`: the answer has the shape of `SGLANG_RETRACT_LOGPROB_BUG` (one logprob fewer than
    output ids, each logprob carrying the id after its own)."""

    def __init__(self, message: str, *, url: str = "", retract_off_by_one: bool = False) -> None:
        super().__init__("/generate", 200, message, url=url)
        self.retract_off_by_one = retract_off_by_one


@dataclass
class SamplingParams:
    """SGLang `sampling_params` (subset the runtime uses; `extra` passes anything else through)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: Alias of `sampling_seed` (SGLang's field name); init-only, never sent as "seed".
    seed: InitVar[int | None] = None

    def __post_init__(self, seed: int | None) -> None:
        if seed is not None:
            if self.sampling_seed is not None and self.sampling_seed != seed:
                raise ValueError(f"seed={seed} and sampling_seed={self.sampling_seed} disagree; give one of them")
            self.sampling_seed = seed

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any]) -> "SamplingParams":
        """From a plain SGLang `sampling_params` dict: known fields by name, `seed` as
        `sampling_seed`, anything else kept in `extra` (sent as is)."""
        known = _field_names(cls)
        kw = {k: v for k, v in params.items() if k in known and v is not None}
        # An explicit null stays explicit (to_json drops None fields): SGLang reads
        # `max_new_tokens: null` as "until the context ends", not as the default 128.
        extra = {k: v for k, v in params.items() if (k not in known or v is None) and k != "seed"}
        if isinstance(kw.get("stop_token_ids"), (list, tuple)):
            kw["stop_token_ids"] = list(kw["stop_token_ids"])
        return cls(**kw, extra=extra, seed=params.get("seed"))

    def to_json(self) -> dict[str, Any]:
        # Shallow on purpose: this runs once per request on the event loop (asdict deep-copies).
        out = {}
        for name in _field_names(type(self)):
            v = getattr(self, name)
            if v is not None:
                out[name] = list(v) if isinstance(v, list) else v
        out.update(self.extra)
        return out

    def replace(self, **changes: Any) -> "SamplingParams":
        if "seed" in changes or not all(k == "extra" or k in _field_names(type(self)) for k in changes):
            new = dataclasses.replace(self, **changes)  # the init-only alias, or a name dataclasses refuses
        else:  # what dataclasses.replace does (__post_init__ has nothing to do without `seed`), per turn cheaper
            new = object.__new__(type(self))
            new.__dict__.update(self.__dict__, **changes)
        if "stop_token_ids" not in changes and new.stop_token_ids is not None:
            new.stop_token_ids = list(new.stop_token_ids)
        if "extra" not in changes:
            new.extra = dict(new.extra)
        return new


@functools.cache
def _field_names(cls: type[SamplingParams]) -> tuple[str, ...]:
    """The fields sent as `sampling_params` (all but `extra`), in order; `dataclasses.fields` per
    request was a visible share of the client's CPU."""
    return tuple(f.name for f in fields(cls) if f.name != "extra")


@dataclass
class GenerateOutput:
    """One generate response, parsed.

    `output_ids` are exactly the tokens the engine sampled (with SGLang's `--skip-tokenizer-init`
    a matched stop token may be the last id); `output_logprobs[i]` is the logprob of `output_ids[i]`.
    `finish_reason` is SGLang's dict: {"type": "stop", "matched": ...} | {"type": "length", "length": n}
    | {"type": "abort", "message": ...}.
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any]
    weight_version: str
    rid: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    e2e_latency: float = 0.0
    server_url: str = ""
    raw_meta: dict[str, Any] = field(default_factory=dict)
    #: Aborted because the engines were drained for a weight update while it ran (set by the gate): the
    #: episode records what it sampled and continues the turn in place under the new weights.
    interrupted_for_update: bool = False

    @property
    def finish_type(self) -> str:
        return str(self.finish_reason.get("type", "")) if self.finish_reason else ""

    @property
    def aborted(self) -> bool:
        return self.finish_type == "abort"


@runtime_checkable
class EngineClient(Protocol):
    """Async operations of one SGLang-compatible server. Implementations raise `EngineError`."""

    url: str

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
    ) -> GenerateOutput: ...

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]: ...

    async def update_weights_from_tensor(
        self,
        named_tensors: Sequence[tuple[str, Any]],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]: ...

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None: ...

    async def flush_cache(self) -> bool: ...

    async def pause_generation(self, mode: PauseMode = "abort") -> None: ...

    async def continue_generation(self) -> None: ...

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None: ...

    async def health(self) -> bool: ...

    async def model_info(self) -> dict[str, Any]: ...

    async def server_info(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


def parse_generate_response(body: Mapping[str, Any], *, rid: str, server_url: str = "") -> GenerateOutput:
    """Turn one SGLang `/generate` JSON object into a `GenerateOutput`, checking ids and logprobs agree."""
    meta = dict(body.get("meta_info") or {})
    output_ids = list(map(int, body.get("output_ids") or []))
    lp_items = meta.get("output_token_logprobs")
    if lp_items is None:
        logprobs: list[float] = []
    else:
        logprobs = [float(item[0]) if item[0] is not None else float("nan") for item in lp_items]
        lp_ids = list(map(int, map(itemgetter(1), lp_items)))
        if lp_ids != output_ids:
            off_by_one = len(lp_ids) == len(output_ids) - 1 and lp_ids == output_ids[1:]
            why = f" (the first token's logprob is missing: {SGLANG_RETRACT_LOGPROB_BUG})" if off_by_one else ""
            raise MisalignedLogprobs(
                f"rid {rid}: {len(lp_ids)} output_token_logprobs with ids {lp_ids[:8]}... disagree with "
                f"{len(output_ids)} output_ids {output_ids[:8]}...{why}",
                url=server_url, retract_off_by_one=off_by_one,
            )
    return GenerateOutput(
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=dict(meta.get("finish_reason") or {}),
        weight_version=str(meta.get("weight_version", "")),
        rid=str(meta.get("id") or rid),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=int(meta.get("completion_tokens") or len(output_ids)),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        e2e_latency=float(meta.get("e2e_latency") or 0.0),
        server_url=server_url,
        raw_meta=meta,
    )
