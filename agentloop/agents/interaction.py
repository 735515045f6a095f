"""The simulated-user hook (like verl's Interaction): after a model turn without tool calls, a
callable `(messages, sample) -> next user message | None` decides whether the conversation goes on.

`ask_user` calls it under a timeout: async callables are awaited; sync ones run in a worker thread so
a slow judge cannot stall the event loop. The reply may be text or a full message dict; None stops.
`scripted_user` is a ready-made interaction that plays `sample.extra["user_turns"]` in order.
"""

from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable, Mapping, Union

import anyio

from ..types import Sample

__all__ = ["Interaction", "ask_user", "scripted_user"]

Reply = Union[str, Mapping[str, Any], None]
Interaction = Callable[[list[dict[str, Any]], Sample], Union[Awaitable[Reply], Reply]]


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


def scripted_user(messages: list[dict[str, Any]], sample: Sample) -> str | None:
    """Plays `sample.extra["user_turns"]` (a list of strings) one per call, then stops."""
    turns = sample.extra.get("user_turns") or []
    asked = sum(1 for m in messages if m.get("role") == "user") - sum(
        1 for m in sample.messages if m.get("role") == "user"
    )
    return str(turns[asked]) if asked < len(turns) else None
