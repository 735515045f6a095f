"""SGLang's penalties and logit_bias in the CPU engine's sampler (sglang/srt/sampling/penaltylib):
frequency and presence penalties subtract per output occurrence / once, the repetition penalty
divides positive and multiplies negative logits of tokens already in the output (the prompt is not
penalised), logit_bias is added, and the reported logprob is the post-penalty one (SGLang's sampler
receives the logits after `apply_logits_bias`)."""

from __future__ import annotations

import pytest
import torch

from agentloop.engine.local.sampling import RequestSampling, SamplingParamsError, process_logits, sample_next


def params(**kw) -> RequestSampling:
    return RequestSampling.from_json(kw, vocab_size=8)


LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, 0.25]])


def test_frequency_and_presence_penalties_count_output_tokens() -> None:
    out = process_logits(LOGITS, [params(frequency_penalty=0.5, presence_penalty=0.25)], [[3, 3, 5]])[0]
    expect = LOGITS[0].clone()
    expect[3] -= 2 * 0.5 + 0.25
    expect[5] -= 1 * 0.5 + 0.25
    assert torch.allclose(out, expect)


def test_repetition_penalty_scales_seen_tokens_by_sign() -> None:
    out = process_logits(LOGITS, [params(repetition_penalty=2.0)], [[0, 1, 1]])[0]
    expect = LOGITS[0].clone()
    expect[0] = 2.0 / 2.0  # positive: divided
    expect[1] = -1.0 * 2.0  # negative: multiplied
    assert torch.allclose(out, expect)


def test_no_output_no_penalty_and_logit_bias_added() -> None:
    out = process_logits(LOGITS, [params(repetition_penalty=2.0, logit_bias={"4": 10.0})], [[]])[0]
    expect = LOGITS[0].clone()
    expect[4] += 10.0
    assert torch.allclose(out, expect)


def test_greedy_pick_and_logprob_are_post_penalty() -> None:
    p = params(temperature=0.0, frequency_penalty=2.0)
    row = sample_next(LOGITS, [p], [torch.Generator()], top_logprobs_nums=[0], outputs=[[3]])[0]
    processed = process_logits(LOGITS, [p], [[3]])
    assert row.token_id == 0  # 3 had the highest logit until the penalty (3.0 - 2.0 < 2.0)
    assert row.logprob == pytest.approx(float(torch.log_softmax(processed, -1)[0, 0]))
    sampled = params(temperature=0.5, presence_penalty=1.0, sampling_seed=1)
    row = sample_next(LOGITS, [sampled], [torch.Generator().manual_seed(1)], top_logprobs_nums=[0], outputs=[[3, 0]])[0]
    scaled = torch.log_softmax(process_logits(LOGITS, [sampled], [[3, 0]]) / 0.5, -1)
    assert row.logprob == pytest.approx(float(scaled[0, row.token_id]))


def test_penalty_ranges_and_nulls_like_sglang() -> None:
    assert params(frequency_penalty=None, presence_penalty=None, repetition_penalty=None, stop_regex=None).penalized is False
    assert params(max_new_tokens=None).max_new_tokens is None
    assert params().max_new_tokens == 128
    for bad, text in [({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2]"),
                      ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2]"),
                      ({"repetition_penalty": 2.5}, "repetition_penalty must be in (0, 2]"),
                      ({"logit_bias": {"8": 1.0}}, "logit_bias must has keys in [0, 7]"),
                      ({"stop_regex": "x"}, "stop_regex")]:
        with pytest.raises(SamplingParamsError) as e:
            params(**bad)
        assert text in str(e.value)
