"""Size budgets for input that must fit a model's context, checked before any parsing, rendering or
tokenization (issue 29, item 5): a byte count is free to take, a chat template render of a 60 MiB
conversation costs minutes.

The bound is one-sided on purpose: a row or request over `bytes_budget(max_context_tokens)` bytes
cannot fit, whatever the tokenizer; one under it may still not fit, and is measured in tokens when
rendered, as before.
"""

from __future__ import annotations

__all__ = ["BYTES_PER_TOKEN", "OVERHEAD_BYTES", "bytes_budget"]

#: Bytes of raw JSON that one token of the context can account for, at most: a token is at most a few
#: dozen characters in the tokenizers we know of, and JSON escaping (`\u4e2d`) takes up to 6 bytes per
#: character. Generous: it only has to stop what cannot possibly fit.
BYTES_PER_TOKEN = 256
#: Room for what carries no prompt tokens (tool schemas, ground truth, extra fields, sampling options).
OVERHEAD_BYTES = 1 << 20


def bytes_budget(max_context_tokens: int) -> int:
    """The most bytes of JSON that can hold a conversation of at most `max_context_tokens` tokens."""
    return max_context_tokens * BYTES_PER_TOKEN + OVERHEAD_BYTES
