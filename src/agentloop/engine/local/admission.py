"""What the CPU engine admits: one generate request's fields checked with SGLang's rules and
messages (token ids in the vocabulary, sampling parameters, logprob options, the context length)
and turned into a `Request`; `EngineInputError` is the refusal, carrying the HTTP status the server
answers with.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

import torch

from .request import Request
from .sampling import NO_LIMIT, RequestSampling, SamplingParamsError

__all__ = ["EngineInputError", "build_request", "check_context"]


class EngineInputError(ValueError):
    """A request the engine refuses; `status` is the HTTP status the server answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def build_request(
    input_ids: Any,
    sampling_params: Any,
    *,
    vocab_size: int,
    context_length: int,
    default_seed: Callable[[], int],
    rid: str | None = None,
    return_logprob: bool | None = False,
    logprob_start_len: int | None = -1,
    top_logprobs_num: int | None = 0,
    priority: Any = None,
    where: str = "input_ids",
) -> Request:
    """One generate request's fields checked (SGLang's rules and messages) and made a `Request`; an
    `EngineInputError` names the bad field. `default_seed()` seeds a request that brings no seed."""
    if not isinstance(input_ids, list) or not input_ids:
        raise EngineInputError(f"{where} must be a non-empty list of token ids")
    for i, t in enumerate(input_ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise EngineInputError(f"{where}[{i}]={t!r} is not an integer token id")
        if not 0 <= t < vocab_size:
            raise EngineInputError(f"{where}[{i}]={t} is out of vocabulary (vocab_size {vocab_size})")
    try:
        sampling = RequestSampling.from_json(sampling_params, vocab_size=vocab_size)
    except SamplingParamsError as e:
        raise EngineInputError(str(e)) from None
    max_new_tokens = check_context(len(input_ids), sampling, context_length)
    if rid is not None and not isinstance(rid, str):
        raise EngineInputError(f"rid must be a string, got {rid!r}")
    if return_logprob is None:
        return_logprob = False
    if not isinstance(return_logprob, bool):
        raise EngineInputError(f"return_logprob must be a boolean, got {return_logprob!r}")
    # SGLang: null means -1 (io_struct), and the start is ignored without return_logprob
    # (scheduler.handle_generate_request); only a start past the input is refused.
    if logprob_start_len is None or not return_logprob:
        logprob_start_len = -1
    if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int) or logprob_start_len < -1:
        raise EngineInputError(f"logprob_start_len must be an integer >= -1, got {logprob_start_len!r}")
    if logprob_start_len > len(input_ids):
        raise EngineInputError(
            f"req.logprob_start_len={logprob_start_len} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={len(input_ids)}. Please use a smaller logprob_start_len."
        )
    if top_logprobs_num is None:
        top_logprobs_num = 0
    if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
        raise EngineInputError(f"top_logprobs_num must be an integer >= 0, got {top_logprobs_num!r}")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise EngineInputError(f"priority must be an integer or null, got {priority!r}")
    seed = sampling.sampling_seed
    if seed is None:
        seed = default_seed()
    gen = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return Request(
        rid=rid or uuid.uuid4().hex,
        input_ids=list(input_ids),
        sampling=sampling,
        generator=gen,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        max_new_tokens=max_new_tokens,
        priority=priority,
    )


def check_context(n_input: int, sampling: RequestSampling, context_length: int) -> int:
    """SGLang's length rules; returns the max_new_tokens the request really gets.

    `TokenizerManager._validate_one_request` refuses an input of >= context_length tokens and an
    explicit max_new_tokens that does not fit beside the input (same messages; the default 128
    of an absent key is not checked, only capped); the scheduler's
    `init_req_max_new_tokens` then caps max_new_tokens (null = 1 << 30) at
    max_req_len - input - 1 with max_req_len = context_length - 1, and lowers min_new_tokens to it.
    """
    ctx = context_length
    if n_input >= ctx:
        raise EngineInputError(
            f"The input ({n_input} tokens) is longer than the model's context length ({ctx} tokens)."
        )
    requested = sampling.max_new_tokens
    if sampling.max_new_tokens_explicit and requested is not None and requested + n_input > ctx:
        raise EngineInputError(
            "Requested token count exceeds the model's maximum context length "
            f"of {ctx} tokens. You requested a total of {requested + n_input} "
            f"tokens: {n_input} tokens from the input messages and "
            f"{requested} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )
    capped = max(0, min(NO_LIMIT if requested is None else requested, (ctx - 1) - n_input - 1))
    sampling.min_new_tokens = min(sampling.min_new_tokens, capped)
    return capped
