"""The simulated-user hook (like verl's Interaction): after a model turn without tool calls, a
callable `(messages, sample) -> next user message | None` decides whether the conversation goes on.

`ask_user` calls it under a timeout: async callables are awaited; sync ones run in a worker thread so
a slow judge cannot stall the event loop. The reply may be text or a full message dict; None stops.
`scripted_user` is a ready-made interaction that plays `sample.extra["user_turns"]` in order.

Interactions are findable by name so YAML configs and dataset rows can pick one:
`@register_interaction("name")` registers a callable, and `get_interaction(spec)` resolves a
registered name or an importable `"package.module:attribute"` path (a class there is instantiated
once with no arguments; its instance is the callable). Resolved paths are cached: one object per
worker, like tools.
"""

from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable, Mapping, Union

import anyio

from ..registry import Registry
from ..types import Sample
from .resolve import import_path

__all__ = [
    "INTERACTIONS",
    "Interaction",
    "ask_user",
    "get_interaction",
    "register_interaction",
    "registered_interactions",
    "scripted_user",
]

Reply = Union[str, Mapping[str, Any], None]
Interaction = Callable[[list[dict[str, Any]], Sample], Union[Awaitable[Reply], Reply]]

def _check_callable(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"interaction {name!r}: {fn!r} is not callable")


INTERACTIONS: Registry[Interaction] = Registry("interaction", check=_check_callable)
_RESOLVED: dict[str, Interaction] = {}  # "module:attr" paths already imported (and built)


def register_interaction(name: str) -> Callable[[Interaction], Interaction]:
    """Decorator: `@register_interaction("name")` makes a simulated user selectable by name."""
    if not name or ":" in name:
        raise ValueError(f"an interaction name must be non-empty and without ':', got {name!r}")
    return INTERACTIONS.register(name)


def registered_interactions() -> list[str]:
    return INTERACTIONS.names()


def get_interaction(spec: Union[str, Interaction]) -> Interaction:
    """The interaction named by `spec`: a registered name, a `"package.module:attribute"` path, or
    already a callable (returned as is). Raises KeyError/ImportError/TypeError saying what is wrong."""
    if callable(spec) and not isinstance(spec, str):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise TypeError(f"an interaction is a name or 'module:function' path, got {spec!r}")
    if spec in INTERACTIONS:
        return INTERACTIONS.get(spec)
    if spec in _RESOLVED:
        return _RESOLVED[spec]
    if ":" not in spec:
        raise KeyError(
            f"unknown interaction {spec!r}; registered: {registered_interactions()} "
            "(or give an importable 'package.module:function' path)"
        )
    obj: Any = import_path(spec, f"interaction {spec!r}")
    if isinstance(obj, type):  # a stateful interaction class (like verl's): one instance per worker
        try:
            obj = obj()
        except Exception as e:
            raise TypeError(f"interaction {spec!r}: {obj.__name__}() failed: {type(e).__name__}: {e}") from e
    if not callable(obj):
        raise TypeError(f"interaction {spec!r} is a {type(obj).__name__}, not callable (messages, sample) -> reply")
    _RESOLVED[spec] = obj
    return obj


async def ask_user(
    interaction: Interaction, messages: list[dict[str, Any]], sample: Sample, *, timeout: float = 60.0
) -> dict[str, Any] | None:
    """The next user message as a chat message dict, or None to stop. Raises TimeoutError past
    `timeout` and TypeError for a reply that is neither text, a user message dict nor None."""
    snapshot = [dict(m) for m in messages]  # the hook must not edit the trajectory's record
    with anyio.fail_after(timeout):
        if inspect.iscoroutinefunction(interaction) or inspect.iscoroutinefunction(
            getattr(interaction, "__call__", None)
        ):
            reply = await interaction(snapshot, sample)  # type: ignore[misc]
        else:
            reply = await anyio.to_thread.run_sync(interaction, snapshot, sample, abandon_on_cancel=True)
            if inspect.isawaitable(reply):
                reply = await reply
    if reply is None:
        return None
    if isinstance(reply, str):
        return {"role": "user", "content": reply}
    if isinstance(reply, Mapping) and isinstance(reply.get("content"), str):
        return {"role": reply.get("role", "user"), **{k: v for k, v in reply.items() if k != "role"}}
    raise TypeError(
        f"interaction {getattr(interaction, '__name__', interaction)!r} returned {type(reply).__name__}; "
        "expected the next user message (str or message dict) or None"
    )


@register_interaction("scripted_user")
def scripted_user(messages: list[dict[str, Any]], sample: Sample) -> str | None:
    """Plays `sample.extra["user_turns"]` (a list of strings) one per call, then stops."""
    turns = sample.extra.get("user_turns") or []
    asked = sum(1 for m in messages if m.get("role") == "user") - sum(
        1 for m in sample.messages if m.get("role") == "user"
    )
    return str(turns[asked]) if asked < len(turns) else None
