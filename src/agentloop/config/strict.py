"""The base of every settings model: unknown keys are refused (a typo must not be silently ignored),
assignments are validated like construction, and true/false is refused where a number is wanted
(pydantic would read `target_groups: true` as 1; a YAML boolean in a count is a mistake, not a value)."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["Strict"]


def _members(tp: Any) -> tuple[Any, ...]:
    """A type's alternatives: a union's members (through Annotated), else the type itself."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _members(typing.get_args(tp)[0])
    if origin is typing.Union or origin is types.UnionType:
        return tuple(m for a in typing.get_args(tp) for m in _members(a))
    return (tp,)


def _refuses_bool(tp: Any) -> bool:
    """A field of type `tp` wants a number and has no place for true/false (no bool, Any, object, or
    Literal of a bool among its alternatives)."""
    members = _members(tp)
    takes_bool = any(m is bool or m is Any or m is object
                     or (typing.get_origin(m) is typing.Literal and any(isinstance(v, bool) for v in typing.get_args(m)))
                     for m in members)
    numeric = any(isinstance(m, type) and issubclass(m, (int, float)) and m is not bool for m in members)
    return numeric and not takes_bool


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if isinstance(value, bool) and field is not None and _refuses_bool(field.annotation):
                    raise ValueError(f"{name}: expected a number, got {value!r}")
        return data
