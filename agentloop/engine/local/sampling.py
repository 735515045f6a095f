"""Sampling for the CPU engine: SGLang `sampling_params` parsing/validation and the sampler.

Owns two things:
- `RequestSampling.from_json`: turns one request's `sampling_params` dict into validated values,
  with SGLang's rules (temperature >= 0, 0 < top_p <= 1, top_k == -1 or >= 1, 0 <= min_p <= 1,
  max_new_tokens >= 0, ...). Anything invalid or unsupported raises `SamplingParamsError` naming
  the field, which the server answers with HTTP 400.
- `sample_next`: one sampling step over a batch of rows, each row with its own parameters and its
  own `torch.Generator` (seeded by `sampling_seed`, else by the server seed and a request counter),
  so a seeded request draws the same tokens whatever else is in the batch.

Logprob convention (checked against SGLang's `layers/sampler.py`): for a sampled request the
returned logprob of token t is `log_softmax(logits / temperature)[t]` — the temperature-scaled
distribution *before* top-k/top-p/min-p truncation (SGLang's default; its env flag
`RETURN_ORIGINAL_LOGPROB` switches to the unscaled `log_softmax(logits)`, which the engine offers as
`--return-original-logprob`). For greedy requests (temperature < 1e-6) the token is the argmax and
its logprob is `log_softmax(logits)[t]`. Top-logprobs use the same distribution as the sampled
token's logprob. Everything is computed in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

GREEDY_EPS = 1e-6

# Accepted keys that only affect detokenized text, which this engine (like SGLang with
# --skip-tokenizer-init) never produces.
_TEXT_ONLY_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
# Keys accepted only at their neutral value (the engine does not implement them otherwise).
_NEUTRAL = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
}
_UNSUPPORTED_IF_SET = {"json_schema", "regex", "ebnf", "structural_tag", "custom_params", "logit_bias"}


class SamplingParamsError(ValueError):
    """A `sampling_params` value is invalid or unsupported; the message names the field."""


def _num(params: Mapping[str, Any], key: str, default: float, kind: type) -> Any:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(f"sampling_params.{key} must be a number, got {value!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise SamplingParamsError(f"sampling_params.{key} must be an integer, got {value!r}")
        return int(value)
    return float(value)


@dataclass
class RequestSampling:
    """Validated sampling parameters of one request."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @classmethod
    def from_json(cls, params: Mapping[str, Any] | None, *, vocab_size: int) -> "RequestSampling":
        if params is None:
            params = {}
        if not isinstance(params, Mapping):
            raise SamplingParamsError(f"sampling_params must be an object, got {type(params).__name__}")
        known = {f for f in cls.__dataclass_fields__} | _TEXT_ONLY_KEYS | set(_NEUTRAL) | _UNSUPPORTED_IF_SET | {"stop"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise SamplingParamsError(f"sampling_params has unknown field(s) {unknown}")
        for key, neutral in _NEUTRAL.items():
            if params.get(key) is not None and params[key] != neutral:
                raise SamplingParamsError(f"sampling_params.{key}={params[key]!r} is not supported by the CPU engine (only {neutral!r})")
        for key in _UNSUPPORTED_IF_SET:
            if params.get(key) is not None:
                raise SamplingParamsError(f"sampling_params.{key} (constrained decoding) is not supported by the CPU engine")
        if params.get("stop"):
            raise SamplingParamsError(
                "sampling_params.stop (string stops) needs a tokenizer; the engine runs like --skip-tokenizer-init: use stop_token_ids"
            )
        s = cls(
            max_new_tokens=_num(params, "max_new_tokens", 128, int),
            min_new_tokens=_num(params, "min_new_tokens", 0, int),
            temperature=_num(params, "temperature", 1.0, float),
            top_p=_num(params, "top_p", 1.0, float),
            top_k=_num(params, "top_k", -1, int),
            min_p=_num(params, "min_p", 0.0, float),
        )
        if s.max_new_tokens < 0:
            raise SamplingParamsError(f"sampling_params.max_new_tokens must be >= 0, got {s.max_new_tokens}")
        if s.min_new_tokens < 0 or s.min_new_tokens > s.max_new_tokens:
            raise SamplingParamsError(f"sampling_params.min_new_tokens must be in [0, max_new_tokens], got {s.min_new_tokens}")
        if s.temperature < 0 or s.temperature != s.temperature:
            raise SamplingParamsError(f"sampling_params.temperature must be >= 0, got {s.temperature}")
        if not 0.0 < s.top_p <= 1.0:
            raise SamplingParamsError(f"sampling_params.top_p must be in (0, 1], got {s.top_p}")
        if s.top_k != -1 and s.top_k < 1:
            raise SamplingParamsError(f"sampling_params.top_k must be -1 (disable) or at least 1, got {s.top_k}")
        if not 0.0 <= s.min_p <= 1.0:
            raise SamplingParamsError(f"sampling_params.min_p must be in [0, 1], got {s.min_p}")
        stop_ids = params.get("stop_token_ids") or []
        if not isinstance(stop_ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise SamplingParamsError(f"sampling_params.stop_token_ids must be a list of ints, got {stop_ids!r}")
        bad = [t for t in stop_ids if not 0 <= t < vocab_size]
        if bad:
            raise SamplingParamsError(f"sampling_params.stop_token_ids {bad} out of vocabulary (vocab_size {vocab_size})")
        s.stop_token_ids = list(stop_ids)
        ignore_eos = params.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise SamplingParamsError(f"sampling_params.ignore_eos must be a boolean, got {ignore_eos!r}")
        s.ignore_eos = ignore_eos
        seed = params.get("sampling_seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise SamplingParamsError(f"sampling_params.sampling_seed must be an integer, got {seed!r}")
        s.sampling_seed = seed
        return s


@dataclass
class RowSample:
    """What the sampler produced for one row."""

    token_id: int
    logprob: float
    top: list[tuple[float, int]] | None = None  # (logprob, token_id) pairs, best first


def sample_next(
    logits: torch.Tensor,
    params: Sequence[RequestSampling],
    generators: Sequence[torch.Generator],
    *,
    top_logprobs_nums: Sequence[int],
    banned: Sequence[Sequence[int]] | None = None,
    original_logprob: bool = False,
) -> list[RowSample]:
    """Sample one token per row of `logits` [B, V] (float32) with each row's own params and RNG.

    `banned[i]` lists token ids masked to -inf for row i before anything else (min_new_tokens keeps
    EOS/stop tokens from being sampled early, as SGLang's min-length penalizer does).
    """
    logits = logits.float()
    if banned is not None and any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, list(ids)] = float("-inf")
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    scaled_logprobs = raw_logprobs if bool((temps == 1.0).all()) else torch.log_softmax(logits / temps[:, None], dim=-1)
    report = raw_logprobs if original_logprob else scaled_logprobs

    out: list[RowSample] = []
    for i, p in enumerate(params):
        if p.greedy:
            token = int(torch.argmax(logits[i]).item())
        else:
            token = _sample_row(scaled_logprobs[i].exp(), p, generators[i])
        top = None
        k = top_logprobs_nums[i]
        if k > 0:
            vals, idx = report[i].topk(min(k, report.shape[-1]))
            top = list(zip(vals.tolist(), idx.tolist()))
        out.append(RowSample(token_id=token, logprob=float(report[i, token].item()), top=top))
    return out


def _sample_row(probs: torch.Tensor, p: RequestSampling, gen: torch.Generator) -> int:
    """Top-k, then top-p, then min-p truncation (SGLang's torch fallback order), then a draw."""
    sorted_probs, sorted_idx = probs.sort(descending=True)
    if p.top_k > 0:
        sorted_probs[p.top_k:] = 0.0
    if p.top_p < 1.0:
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep a token while the mass before it is <= top_p: the first token always survives.
        sorted_probs[(cum - sorted_probs) > p.top_p] = 0.0
    if p.min_p > 0.0:
        sorted_probs[sorted_probs < sorted_probs[0] * p.min_p] = 0.0
    choice = torch.multinomial(sorted_probs, num_samples=1, generator=gen)
    return int(sorted_idx[choice].item())
