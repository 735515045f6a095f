"""The base of every settings model: unknown keys are refused (a typo must not be silently ignored) and
assignments are validated like construction."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Strict"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
