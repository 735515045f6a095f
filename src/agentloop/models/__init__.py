"""Shipped models and model builders (the tiny tool-calling model, random test models).

`tiny_tool_model()` locates the tiny tool-calling model that ships as package data in
`src/agentloop/models/tiny_tool/` (trained by `tools/train_tiny_model.py`; see its MODEL_CARD.md).
Random-weight test models live in `random_model.py`; `weak_tiny_tool_model()` (`weak.py`) is the tiny
model with seeded noise on its weights, a weak start for demos that must show learning.
"""

from __future__ import annotations

__all__ = ["tiny_tool_model", "weak_tiny_tool_model"]

from .tiny import tiny_tool_model
from .weak import weak_tiny_tool_model
