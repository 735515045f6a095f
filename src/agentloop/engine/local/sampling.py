"""Sampling for the CPU engine: SGLang `sampling_params` parsing/validation and the sampler.

Owns three things:
- `RequestSampling.from_json`: turns one request's `sampling_params` dict into validated values,
  with SGLang's rules and messages (`sampling/sampling_params.py` `verify`: temperature >= 0,
  0 < top_p <= 1, top_k == -1 or >= 1, 0 <= min_p <= 1, max_new_tokens >= 0, penalties in range,
  logit_bias keys in vocabulary, ...). `null` means the default, as in SGLang's `__post_init__`;
  `max_new_tokens: null` means "until the context ends" (SGLang: 1 << 30, then clipped). Anything
  invalid or unsupported raises `SamplingParamsError` naming the field (HTTP 400).
- `sample_next`: one sampling step over a batch of rows, each row with its own parameters and its
  own `torch.Generator` (seeded by `sampling_seed`, else by the server seed and a request counter),
  so a seeded request draws the same tokens whatever else is in the batch.
- `input_logprobs`: a prompt's token logprobs from its prefill, in the same convention.

Logit processing follows SGLang's `SamplingBatchInfo.apply_logits_bias` (penaltylib), in order:
frequency penalty (minus penalty x count of the token in the *output* so far), presence penalty
(minus penalty if it occurred in the output), repetition penalty (output tokens only: a positive
logit is divided by it, a negative one multiplied), then `logit_bias` (added), then min_new_tokens
masking of EOS/stop ids. SGLang's penalizers only ever see output tokens (`cumulate_output_tokens`;
there is no input-token hook in penaltylib), so the prompt is not penalised here either.

Logprob convention (checked against SGLang's `layers/sampler.py`): the sampler receives the logits
*after* `apply_logits_bias` (model_runner applies penalties in place before calling it), so every
returned logprob is post-penalty. For a sampled request the logprob of token t is
`log_softmax(processed_logits / temperature)[t]` — the temperature-scaled distribution *before*
top-k/top-p/min-p truncation (SGLang's default; its env flag `RETURN_ORIGINAL_LOGPROB` switches to
`log_softmax(processed_logits)`, which the engine offers as `--return-original-logprob`). For greedy
requests (temperature < 1e-6; SGLang turns them into top_k=1 at temperature 1) the token is the
argmax and its logprob `log_softmax(processed_logits)[t]`. Top-logprobs use the same distribution as
the sampled token's logprob. Everything is computed in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

GREEDY_EPS = 1e-6
#: SGLang's stand-in for "no limit" on max_new_tokens (`init_req_max_new_tokens`: 1 << 30).
NO_LIMIT = 1 << 30

# Accepted keys that only affect detokenized text, which this engine (like SGLang with
# --skip-tokenizer-init) never produces.
_TEXT_ONLY_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
# Need a tokenizer (string matching): refused when set, like SGLang with --skip-tokenizer-init.
_NEEDS_TOKENIZER = {"stop": "stop (string stops)", "stop_regex": "stop_regex"}
_UNSUPPORTED_IF_SET = {"json_schema", "regex", "ebnf", "structural_tag", "custom_params"}


class SamplingParamsError(ValueError):
    """A `sampling_params` value is invalid or unsupported; the message names the field."""


def _num(params: Mapping[str, Any], key: str, default: Any, kind: type) -> Any:
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


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float] | None:
    """SGLang's `logit_bias`: {"token_id": bias} (JSON keys are strings), keys in the vocabulary."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SamplingParamsError(f"sampling_params.logit_bias must be an object {{token_id: bias}}, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise SamplingParamsError(f"sampling_params.logit_bias key {key!r} is not a token id") from None
        if not 0 <= tid < vocab_size:
            raise SamplingParamsError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {tid}.")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise SamplingParamsError(f"sampling_params.logit_bias[{key!r}] must be a number, got {bias!r}")
        out[tid] = float(bias)
    return out


@dataclass
class RequestSampling:
    """Validated sampling parameters of one request."""

    #: None = no limit (`max_new_tokens: null`): the engine clips it to the context.
    max_new_tokens: int | None = 128
    #: The request named a number (SGLang checks only those against the context length).
    max_new_tokens_explicit: bool = False
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    n: int = 1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @classmethod
    def from_json(cls, params: Mapping[str, Any] | None, *, vocab_size: int) -> "RequestSampling":
        if params is None:
            params = {}
        if not isinstance(params, Mapping):
            raise SamplingParamsError(f"sampling_params must be an object, got {type(params).__name__}")
        known = ({f for f in cls.__dataclass_fields__} - {"max_new_tokens_explicit"}) | _TEXT_ONLY_KEYS | set(_NEEDS_TOKENIZER) | _UNSUPPORTED_IF_SET
        unknown = sorted(set(params) - known)
        if unknown:
            raise SamplingParamsError(f"sampling_params has unknown field(s) {unknown}")
        for key in sorted(_UNSUPPORTED_IF_SET):
            if params.get(key):  # SGLang: an empty grammar means unset
                raise SamplingParamsError(f"sampling_params.{key} (constrained decoding) is not supported by the CPU engine")
        for key, what in _NEEDS_TOKENIZER.items():
            if params.get(key):  # null / "" / [] are unset, as in SGLang
                raise SamplingParamsError(
                    f"sampling_params.{what} needs a tokenizer; the engine runs like --skip-tokenizer-init: use stop_token_ids"
                )
        s = cls(
            max_new_tokens=_num(params, "max_new_tokens", None, int) if "max_new_tokens" in params else 128,
            min_new_tokens=_num(params, "min_new_tokens", 0, int),
            temperature=_num(params, "temperature", 1.0, float),
            top_p=_num(params, "top_p", 1.0, float),
            top_k=_num(params, "top_k", -1, int),
            min_p=_num(params, "min_p", 0.0, float),
            frequency_penalty=_num(params, "frequency_penalty", 0.0, float),
            presence_penalty=_num(params, "presence_penalty", 0.0, float),
            repetition_penalty=_num(params, "repetition_penalty", 1.0, float),
            n=_num(params, "n", 1, int),
        )
        # Messages are SGLang's (`SamplingParams.verify`), so both engines say the same thing.
        if not math.isfinite(s.temperature) or s.temperature < 0:
            raise SamplingParamsError(f"temperature must be a non-negative finite number, got {s.temperature}.")
        if not 0.0 < s.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {s.top_p}.")
        if not 0.0 <= s.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {s.min_p}.")
        if s.top_k != -1 and s.top_k < 1:
            raise SamplingParamsError(f"top_k must be -1 (disable) or at least 1, got {s.top_k}.")
        if not -2.0 <= s.frequency_penalty <= 2.0:
            raise SamplingParamsError(f"frequency_penalty must be in [-2, 2], got {s.frequency_penalty}.")
        if not -2.0 <= s.presence_penalty <= 2.0:
            raise SamplingParamsError(f"presence_penalty must be in [-2, 2], got {s.presence_penalty}.")
        if not 0.0 < s.repetition_penalty <= 2.0:
            raise SamplingParamsError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {s.repetition_penalty}.")
        if s.min_new_tokens < 0:
            raise SamplingParamsError(f"min_new_tokens must be in [0, max_new_tokens], got {s.min_new_tokens}.")
        if s.max_new_tokens is not None:
            if s.max_new_tokens < 0:
                raise SamplingParamsError(f"max_new_tokens must be at least 0, got {s.max_new_tokens}.")
            if s.min_new_tokens > s.max_new_tokens:
                raise SamplingParamsError(
                    f"min_new_tokens must be in [0, max_new_tokens({s.max_new_tokens})], got {s.min_new_tokens}."
                )
        s.max_new_tokens_explicit = params.get("max_new_tokens") is not None
        if s.n < 1:
            raise SamplingParamsError(f"sampling_params.n must be at least 1, got {s.n}")
        s.logit_bias = _logit_bias(params.get("logit_bias"), vocab_size)
        stop_ids = params.get("stop_token_ids") or []
        if not isinstance(stop_ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise SamplingParamsError(f"sampling_params.stop_token_ids must be a list of ints, got {stop_ids!r}")
        bad = [t for t in stop_ids if not 0 <= t < vocab_size]
        if bad:
            raise SamplingParamsError(f"sampling_params.stop_token_ids {bad} out of vocabulary (vocab_size {vocab_size})")
        s.stop_token_ids = list(stop_ids)
        ignore_eos = params.get("ignore_eos")
        if ignore_eos is not None and not isinstance(ignore_eos, bool):
            raise SamplingParamsError(f"sampling_params.ignore_eos must be a boolean, got {ignore_eos!r}")
        s.ignore_eos = bool(ignore_eos)
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


def process_logits(
    logits: torch.Tensor,
    params: Sequence[RequestSampling],
    outputs: Sequence[Sequence[int]] | None = None,
    banned: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """SGLang's `apply_logits_bias` for a batch: penalties over each row's output tokens so far,
    logit_bias, then min_new_tokens masking (`banned[i]` -> -inf). Returns a new float32 tensor."""
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if p.penalized and outputs is not None and len(outputs[i]) > 0:
            ids = torch.tensor(list(outputs[i]), dtype=torch.long)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].to(torch.float32)
            seen = counts > 0
            row = logits[i]
            if p.frequency_penalty != 0.0:
                row -= p.frequency_penalty * counts
            if p.presence_penalty != 0.0:
                row -= p.presence_penalty * seen.to(torch.float32)
            if p.repetition_penalty != 1.0:
                scaled = torch.where(row < 0, row * p.repetition_penalty, row / p.repetition_penalty)
                row.copy_(torch.where(seen, scaled, row))
        if p.logit_bias:
            idx = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[i, idx] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
    if banned is not None:
        for i, ids in enumerate(banned):
            if ids:
                logits[i, list(ids)] = float("-inf")
    return logits


def sample_next(
    logits: torch.Tensor,
    params: Sequence[RequestSampling],
    generators: Sequence[torch.Generator],
    *,
    top_logprobs_nums: Sequence[int],
    banned: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    original_logprob: bool = False,
) -> list[RowSample]:
    """Sample one token per row of `logits` [B, V] (float32) with each row's own params and RNG.

    `outputs[i]` are row i's output tokens so far (for the penalties); `banned[i]` lists token ids
    masked to -inf for row i (min_new_tokens keeps EOS/stop tokens from being sampled early, as
    SGLang's min-length penalizer does). Logprobs come from the processed logits (module docstring).
    """
    logits = process_logits(logits, params, outputs, banned)
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


def input_logprobs(logits: torch.Tensor, ids: Sequence[int], start: int, p: RequestSampling, top_n: int, *,
                   original_logprob: bool = False) -> tuple[list[float | None], list[list[tuple[float, int]] | None] | None]:
    """Logprobs of the prompt tokens `ids[start:]` from a prefill's `logits` over `ids` (row j predicts
    token j+1), in the sampled tokens' convention (temperature-scaled unless greedy or original); the first
    token, which nothing predicts, gets None. Top logprobs (None unless `top_n`) likewise."""
    temp = 1.0 if (p.greedy or original_logprob) else p.temperature
    lps = torch.log_softmax(logits[:-1] / temp, dim=-1)
    values: list[float | None] = []
    tops: list[list[tuple[float, int]] | None] = []
    for j in range(start, len(ids)):
        if j == 0:
            values.append(None)
            tops.append(None)
            continue
        values.append(float(lps[j - 1, ids[j]].item()))
        if top_n > 0:
            v, i = lps[j - 1].topk(min(top_n, lps.shape[-1]))
            tops.append(list(zip(v.tolist(), i.tolist())))
    return values, tops if top_n > 0 else None
