"""Truncation of tool output by tokens (never characters), on the left, right and middle, with a real
byte-level BPE tokenizer built here with `tokenizers` (and the shipped tiny model's when present)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from agentloop.tools.truncate import count_tokens, truncate_by_tokens

CORPUS = [
    "Traceback (most recent call last): File line in module ValueError invalid literal for int",
    "The answer is 396. Let me compute 12 * 33 with the calculator tool.",
    "def main(): print(sum(range(10))) return None import math sqrt",
    "éèà ünïcödé 数字 計算 — emoji 🙂 tokens",
] * 20


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def hf(bpe):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=bpe)


def tiny_or_skip():
    try:
        from agentloop.models import tiny_tool_model

        path = tiny_tool_model()
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"tiny tool model not available: {e}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


TEXT = " ".join(f"line {i}: value={i * 37 % 101} status ok" for i in range(60))


@pytest.mark.parametrize("which", ["raw", "hf"])
@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_each_side_keeps_the_right_part_within_budget(bpe, hf, which, side):
    tok = bpe if which == "raw" else hf
    n = count_tokens(tok, TEXT)
    assert n > 200 and n < len(TEXT)  # tokens, not characters
    out, cut = truncate_by_tokens(TEXT, tok, 50, side)
    assert cut
    assert count_tokens(tok, out) <= 50
    m = re.search(r"\.\.\.\(truncated (\d+) tokens\)\.\.\.", out)
    assert m, out
    dropped = int(m.group(1))
    head, tail = out[: m.start()], out[m.end():]
    kept_ids = count_tokens(tok, head) + count_tokens(tok, tail)
    assert abs((n - dropped) - kept_ids) <= 2  # the marker's count is in tokens of the original
    if side == "right":
        assert tail == "" and TEXT.startswith(head) and len(head) > 20
    elif side == "left":
        assert head == "" and TEXT.endswith(tail) and len(tail) > 20
    else:
        assert TEXT.startswith(head) and TEXT.endswith(tail) and len(head) > 10 and len(tail) > 10


def test_no_truncation_when_it_fits(bpe):
    assert truncate_by_tokens("short text", bpe, 100, "middle") == ("short text", False)
    n = count_tokens(bpe, TEXT)
    assert truncate_by_tokens(TEXT, bpe, n, "left") == (TEXT, False)
    out, cut = truncate_by_tokens(TEXT, bpe, n - 1, "left")
    assert cut and count_tokens(bpe, out) <= n - 1


def test_budget_smaller_than_the_marker(bpe):
    out, cut = truncate_by_tokens(TEXT, bpe, 3, "middle")
    assert cut and count_tokens(bpe, out) <= 3
    assert truncate_by_tokens(TEXT, bpe, 0, "right") == ("", True)


def test_bad_arguments(bpe):
    with pytest.raises(ValueError, match="side"):
        truncate_by_tokens(TEXT, bpe, 10, "top")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens"):
        truncate_by_tokens(TEXT, bpe, -1, "left")


def test_multibyte_cut_leaves_no_replacement_characters(bpe):
    text = "数字計算🙂" * 80
    for side in ("left", "right", "middle"):
        out, cut = truncate_by_tokens(text, bpe, 40, side)
        assert cut and "\ufffd" not in out and count_tokens(bpe, out) <= 40


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=400), st.integers(min_value=0, max_value=120), st.sampled_from(["left", "right", "middle"]))
def test_property_never_over_budget(bpe, text, budget, side):
    out, cut = truncate_by_tokens(text, bpe, budget, side)
    n = count_tokens(bpe, text)
    assert cut == (n > budget)
    assert count_tokens(bpe, out) <= budget or not cut
    if not cut:
        assert out == text


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_with_the_tiny_models_tokenizer(side):
    tok = tiny_or_skip()
    out, cut = truncate_by_tokens(TEXT, tok, 40, side)
    assert cut and count_tokens(tok, out) <= 40 and "truncated" in out
