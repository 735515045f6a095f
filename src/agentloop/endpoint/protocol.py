"""The OpenAI chat-completions wire format the endpoint speaks: requests in, responses and errors out.

This module owns the *shapes* only (no tokens, no HTTP): `ChatCompletionRequest` validates a
`POST /v1/chat/completions` body (OpenAI's fields, plus SGLang's extensions `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids` that `extra_body=` carries), `normalize_messages`
turns the request's messages into the form chat templates render (and the form the recorder compares),
and the `*_body` functions build OpenAI-shaped responses, stream chunks and errors. What the runtime
cannot do faithfully is refused with a 400 naming the field (`n` > 1, `tool_choice` "required" or a
named function — the engine samples freely, there is no constrained decoding —, `logit_bias`,
`top_logprobs`, a non-text `response_format`, non-text content parts) rather than silently ignored.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "ChatCompletionRequest",
    "CompletionResult",
    "EndpointError",
    "chunk_bodies",
    "completion_body",
    "error_body",
    "models_body",
    "normalize_messages",
    "parse_request",
    "message_key",
]

_ROLES = ("system", "developer", "user", "assistant", "tool")


class EndpointError(Exception):
    """A request the endpoint answers with an OpenAI-style error (HTTP `status`, `type`, `code`, `param`).

    `retry` is sent as the `x-should-retry` header: the official clients honour it, and none of the
    endpoint's errors get better by repeating the same request."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry = retry


class ChatCompletionRequest(BaseModel):
    """A chat-completions request. Unknown fields (`user`, `metadata`, `store`, ...) are accepted and
    ignored, as OpenAI-compatible servers do; fields that would change the answer are checked."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # SGLang's extensions of the OpenAI API (sent by clients through `extra_body`).
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None

    # ------------------------------------------------------------------ derived
    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def parse_tool_calls(self) -> bool:
        """Whether the model's text is parsed into `tool_calls` (tools given and tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def sampling_overrides(self) -> dict[str, Any]:
        """The request's sampling fields as `SamplingParams.replace` keywords (unset fields keep the
        runtime's configured sampling)."""
        out: dict[str, Any] = {}
        for name, target in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                             ("min_p", "min_p"), ("seed", "sampling_seed"), ("ignore_eos", "ignore_eos"),
                             ("stop_token_ids", "stop_token_ids")):
            value = getattr(self, name)
            if value is not None:
                out[target] = value
        extra = {k: getattr(self, k) for k in ("frequency_penalty", "presence_penalty", "repetition_penalty")
                 if getattr(self, k) is not None}
        if extra:
            out["extra"] = extra
        return out

    def check_supported(self) -> None:
        """Raise `EndpointError` (400, naming the field) for what the runtime cannot honour."""
        if self.n not in (None, 1):
            raise EndpointError(400, f"n={self.n}: one completion per request (send n requests; a trajectory "
                                "is one conversation)", param="n")
        choice = self.tool_choice
        if choice not in (None, "auto", "none"):
            raise EndpointError(400, f"tool_choice={choice!r} is not supported: the engine samples freely (no "
                                "constrained decoding), so only 'auto' and 'none' can be honoured", param="tool_choice")
        if self.logit_bias:
            raise EndpointError(400, "logit_bias is not supported", param="logit_bias")
        if self.top_logprobs:
            raise EndpointError(400, "top_logprobs is not supported (logprobs=true returns the sampled tokens' "
                                "logprobs)", param="top_logprobs")
        fmt = (self.response_format or {}).get("type", "text")
        if fmt != "text":
            raise EndpointError(400, f"response_format type {fmt!r} is not supported (no constrained decoding)",
                                param="response_format")
        for i, tool in enumerate(self.tools or []):
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if tool.get("type", "function") != "function" or not isinstance(fn, Mapping) or not fn.get("name"):
                raise EndpointError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                    "'parameters': ...}}}}", param=f"tools[{i}]")


def parse_request(body: Any) -> ChatCompletionRequest:
    """Validate a request body; raises `EndpointError` (400) naming the first bad field."""
    if not isinstance(body, Mapping):
        raise EndpointError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise EndpointError(400, f"{where}: {err['msg']}", param=where) from None
    req.check_supported()
    return req


# ---------------------------------------------------------------------------------------------------- messages


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise EndpointError(400, f"{where}.content[{j}]: content part {kind!r} is not supported (text only)",
                                    param=f"{where}.content")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise EndpointError(400, f"{where}.content must be a string, a list of text parts or null, got "
                        f"{type(content).__name__}", param=f"{where}.content")


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as templates want them: a dict when the JSON string parses (as SGLang and
    vLLM do before templating), else the string as the model wrote it."""
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            return raw
        return parsed if isinstance(parsed, dict) else raw
    return raw if raw is not None else {}


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The request's messages in the form chat templates render: `developer` → `system`, content as
    text, assistant `tool_calls` with `function.arguments` parsed from JSON. Raises `EndpointError`
    naming `messages[i]` for anything malformed."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise EndpointError(400, f"{where} must be an object, got {type(m).__name__}", param=where)
        role = m.get("role")
        if role not in _ROLES:
            raise EndpointError(400, f"{where}.role must be one of {list(_ROLES)}, got {role!r}", param=f"{where}.role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise EndpointError(400, f"{where}.tool_calls[{j}] needs function.name", param=f"{where}.tool_calls")
                call = {"type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"))}}
                if c.get("id"):
                    call["id"] = c["id"]
                calls.append(call)
            msg["tool_calls"] = calls
        if role == "tool" and m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name") and role != "assistant":
            msg["name"] = m["name"]
        out.append(msg)
    return out


def message_key(m: Mapping[str, Any]) -> str:
    """What makes two normalized messages the same turn for the model: role, text, tool calls by
    name and arguments (ids are the runtime's labels, not sampled text), tool_call_id and name of
    other messages. Used to tell an extended conversation from a rewritten one."""
    key: dict[str, Any] = {"role": m["role"], "content": m.get("content", "")}
    if m["role"] == "assistant":
        key["tool_calls"] = [[c["function"]["name"], c["function"]["arguments"]] for c in m.get("tool_calls") or []]
    else:
        key["tool_call_id"] = m.get("tool_call_id")
        key["name"] = m.get("name")
    return json.dumps(key, sort_keys=True, ensure_ascii=False, default=str)


# ---------------------------------------------------------------------------------------------------- responses


@dataclass
class CompletionResult:
    """One answered call, before it is put on the wire."""

    id: str
    message: dict[str, Any]  #: {"role": "assistant", "content": str | None, "tool_calls"?: [...]}
    finish_reason: Literal["stop", "length", "tool_calls"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str = ""
    segment: int = 0
    #: (token text, logprob) of each returned token, when the request asked for logprobs.
    logprobs: list[tuple[str, float]] | None = None
    created: int = field(default_factory=lambda: int(time.time()))


def _usage(r: CompletionResult) -> dict[str, Any]:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
    }


def _logprobs(r: CompletionResult) -> dict[str, Any] | None:
    if r.logprobs is None:
        return None
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in r.logprobs]}


def _extension(r: CompletionResult) -> dict[str, Any]:
    # Extra top-level field (clients keep unknown fields): which training segment and weights served it.
    return {"segment": r.segment, "weight_version": r.weight_version}


def completion_body(r: CompletionResult, model: str) -> dict[str, Any]:
    """A `chat.completion` object."""
    return {
        "id": r.id,
        "object": "chat.completion",
        "created": r.created,
        "model": model,
        "system_fingerprint": r.weight_version or None,
        "choices": [{"index": 0, "message": r.message, "finish_reason": r.finish_reason, "logprobs": _logprobs(r)}],
        "usage": _usage(r),
        "agentloop": _extension(r),
    }


def chunk_bodies(r: CompletionResult, model: str, *, include_usage: bool) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects of a streamed answer: the role, the content, one chunk per
    tool call (id, name and all its arguments), the finish reason, then usage if asked for. The turn
    is generated whole before the first chunk is sent (the runtime's generate path is not incremental)."""
    base = {"id": r.id, "object": "chat.completion.chunk", "created": r.created, "model": model,
            "system_fingerprint": r.weight_version or None}

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

    out = [chunk({"role": "assistant", "content": ""})]
    if r.message.get("content"):
        out.append(chunk({"content": r.message["content"]}, logprobs=_logprobs(r)))
    for i, call in enumerate(r.message.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": i, **call}]}))
    out.append({**chunk({}, r.finish_reason), "agentloop": _extension(r)})
    if include_usage:
        out.append({**base, "choices": [], "usage": _usage(r)})
    return out


def error_body(e: EndpointError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def models_body(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "agentloop"}]}
