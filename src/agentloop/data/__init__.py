"""Datasets shipped with agentloop: `arithmetic.jsonl`, the prompts of the CPU demo (64 arithmetic
questions with their answers, for the `calculator` tool), made by `tools/make_arithmetic_data.py`."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def arithmetic_prompts() -> Path:
    """Path of the bundled arithmetic prompt set (JSONL, one row per question)."""
    return _HERE / "arithmetic.jsonl"
