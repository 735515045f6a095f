"""The token buffer of one conversation: what the engine sees, what the trainer gets.

`TokenBuffer` owns the token sequence of one trajectory. It starts from the prompt messages (and tool
schemas) rendered by the tokenizer's own chat template with the generation prompt. Model turns are
appended as exactly the ids the engine returned, with its logprobs, mask 1 — a model turn is never
decoded and re-encoded. Tool results and user turns are appended as the chat-template *delta*
(mask 0): a fixed base conversation is rendered with and without the new messages and the token
difference is taken, so templates that inject a default system prompt, trim text or put the tool
schemas anywhere still yield exactly the tokens the template would. Before a delta, the template's
closing tokens of the previous assistant turn are inserted (mask 0) when the engine did not sample
them itself (e.g. a turn cut by `max_new_tokens` has no end-of-turn token; Qwen's `<|im_end|>` is
followed by a newline the model never samples).

Invariant (checked by `Trajectory.check_invariants` and the property tests): `prompt_ids +
response_ids` is the engine's input at the last turn plus what it sampled; the mask-1 positions hold
the sampled ids in order, with their logprobs.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from .engine.base import GenerateOutput
from .types import Trajectory, TrajectoryStatus, TurnRecord

__all__ = ["ChatTemplateError", "TemplateDelta", "TokenBuffer", "render_ids"]

# Placeholders of the fixed base conversation used to measure template deltas. Plain words so that
# every tokenizer (byte-level or not) can encode them.
_BASE_USER = "Hello there."
_BASE_ASSISTANT = "Zq7 base reply Zq7"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot produce a clean delta for these messages."""


def _render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **dict(chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja errors (e.g. "roles must alternate") name the template, not us
        roles = [m.get("role") for m in messages]
        raise ChatTemplateError(f"chat template of {type(tokenizer).__name__} failed on roles {roles}: {e}") from e
    if not isinstance(text, str):
        raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
    return text


def _encode(tokenizer: Any, text: str) -> list[int]:
    # The template writes BOS/special tokens itself: adding them again would double them.
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's own chat template."""
    text = _render(
        tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs,
    )
    return _encode(tokenizer, text)


class TemplateDelta:
    """Measures one tokenizer's template: closing tokens of an assistant turn and message deltas.

    Built once per (tokenizer, tools, kwargs) and reused by every buffer that shares them.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.kwargs = dict(chat_template_kwargs or {})
        self._base = [
            {"role": "user", "content": _BASE_USER},
            {"role": "assistant", "content": _BASE_ASSISTANT},
        ]
        base_text = self._render(self._base, add_generation_prompt=False)
        at = base_text.rfind(_BASE_ASSISTANT)
        if at < 0:
            raise ChatTemplateError("chat template does not render assistant content verbatim; cannot find turn ends")
        #: Template text after an assistant message's content (e.g. "<|im_end|>\n", "<|eot_id|>").
        self.closing_text = base_text[at + len(_BASE_ASSISTANT):]
        self.closing_ids = _encode(tokenizer, self.closing_text)
        self._base_text = base_text
        self._base_ids = _encode(tokenizer, base_text)

    def _render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool) -> str:
        return _render(
            self.tokenizer, messages, tools=self.tools, add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=self.kwargs,
        )

    def closing_for(self, turn_ids: Sequence[int]) -> list[int]:
        """Template tokens still missing after a sampled assistant turn before the next message.

        If the turn ends with the template's end-of-turn token (the first closing token, e.g. EOS
        `<|im_end|>`), only the rest (e.g. "\\n") is missing; otherwise (cut by length, or stopped on
        another stop token) the whole closing is inserted.
        """
        closing = self.closing_ids
        if closing and turn_ids and turn_ids[-1] == closing[0]:
            return closing[1:]
        return list(closing)

    def messages_delta(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids the template adds for `messages` after a finished assistant turn, including the
        generation prompt of the next assistant turn."""
        if not messages:
            return []
        full_text = self._render([*self._base, *messages], add_generation_prompt=True)
        full_ids = _encode(self.tokenizer, full_text)
        n = len(self._base_ids)
        if full_ids[:n] == self._base_ids:
            return full_ids[n:]
        # Token boundaries moved across the join (a BPE merge), or the template renders the earlier
        # turns differently once more messages follow (Qwen3 drops the empty <think> block of an
        # assistant turn before the last user query). What follows the base assistant's content and
        # closing is still the delta: the buffer keeps the sampled turn as it was, like the engine saw it.
        at = full_text.find(_BASE_ASSISTANT)
        after = at + len(_BASE_ASSISTANT)
        if at >= 0 and full_text.startswith(self.closing_text, after):
            return _encode(self.tokenizer, full_text[after + len(self.closing_text):])
        roles = [m.get("role") for m in messages]
        raise ChatTemplateError(
            f"chat template changes an assistant turn's content or closing when messages with roles {roles} "
            "follow it; no token delta exists"
        )


_DELTA_CACHE: dict[tuple[int, str, str], TemplateDelta] = {}


def template_delta(
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> TemplateDelta:
    """A cached `TemplateDelta` (keyed by tokenizer identity, tools and template kwargs)."""
    key = (
        id(tokenizer),
        json.dumps(tools or None, sort_keys=True, default=str),
        json.dumps(dict(chat_template_kwargs or {}), sort_keys=True, default=str),
    )
    d = _DELTA_CACHE.get(key)
    if d is None or d.tokenizer is not tokenizer:
        d = TemplateDelta(tokenizer, tools=tools, chat_template_kwargs=chat_template_kwargs)
        if len(_DELTA_CACHE) > 256:  # bounded: tokenizers are few, but ids can be reused after GC
            _DELTA_CACHE.clear()
        _DELTA_CACHE[key] = d
    return d


class TokenBuffer:
    """Token ids, mask and logprobs of one conversation; see the module docstring.

    Construct with `TokenBuffer(tokenizer, messages, tools)` (renders the prompt), or with
    `prompt_ids=` to start from given ids (no template; `append_messages` then needs a tokenizer
    whose template can measure deltas). `TokenBuffer.from_trajectory` resumes an aborted trajectory.
    """

    def __init__(
        self,
        tokenizer: Any,
        messages: Sequence[Mapping[str, Any]] = (),
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if prompt_ids is None:
            if tokenizer is None:
                raise ValueError("TokenBuffer needs a tokenizer to render the prompt, or prompt_ids")
            if not messages:
                raise ValueError("TokenBuffer needs prompt messages (or prompt_ids)")
            prompt_ids = render_ids(
                tokenizer, messages, tools=self.tools, add_generation_prompt=True,
                chat_template_kwargs=self.chat_template_kwargs,
            )
        self.prompt_ids: list[int] = list(map(int, prompt_ids))
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.response_logprobs: list[float] = []
        self.turns: list[TurnRecord] = []
        #: Readable conversation (prompt + decoded turns), for people only; never re-tokenized.
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]
        #: Start (in response_ids) of the assistant message still open (no closing appended yet).
        self._open_turn_start: int | None = None

    # ------------------------------------------------------------------ state
    @property
    def ids(self) -> list[int]:
        """The engine's input for the next turn: prompt + everything appended so far."""
        return self.prompt_ids + self.response_ids

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def open_turn_ids(self) -> list[int]:
        """Ids of the assistant message being built (several engine turns when a partial rollout
        continued an aborted one); empty if none is open."""
        if self._open_turn_start is None:
            return []
        return self.response_ids[self._open_turn_start:]

    def remaining(self, max_response_tokens: int, max_context_tokens: int | None = None) -> int:
        """Tokens that may still be added: the smaller of the response budget and the context room.
        Clamp each turn's `max_new_tokens` to this; <= 0 means the budget is spent."""
        left = max_response_tokens - self.response_len
        if max_context_tokens is not None:
            left = min(left, max_context_tokens - self.total_len)
        return left

    # ------------------------------------------------------------------ appends
    def append_model_turn(
        self,
        output: GenerateOutput,
        *,
        generate_seconds: float = 0.0,
        server_url: str | None = None,
    ) -> TurnRecord:
        """Append exactly the engine's ids and logprobs (mask 1) and record the turn."""
        ids = list(map(int, output.output_ids))
        lps = list(map(float, output.output_logprobs))
        if len(lps) != len(ids):
            raise ValueError(
                f"engine returned {len(ids)} output ids but {len(lps)} logprobs (rid {output.rid!r}); "
                "generate with return_logprob=True"
            )
        start = len(self.response_ids)
        if self._open_turn_start is None:
            self._open_turn_start = start
        self.response_ids.extend(ids)
        self.response_mask.extend([1] * len(ids))
        self.response_logprobs.extend(lps)
        rec = TurnRecord(
            start=start,
            length=len(ids),
            weight_version=output.weight_version,
            finish_reason=dict(output.finish_reason),
            server_url=server_url if server_url is not None else output.server_url,
            generate_seconds=generate_seconds,
            cached_tokens=output.cached_tokens,
        )
        self.turns.append(rec)
        return rec

    def append_tokens(self, ids: Sequence[int]) -> None:
        """Append non-sampled tokens verbatim (mask 0), e.g. a replayed tool result. Closes the open turn."""
        self._extend_fixed(list(map(int, ids)))
        self._open_turn_start = None

    def _extend_fixed(self, ids: list[int]) -> None:
        self.response_ids.extend(ids)
        self.response_mask.extend([0] * len(ids))
        self.response_logprobs.extend([0.0] * len(ids))

    def delta_for(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The ids `append_messages(messages)` would append (closing + template delta), without appending."""
        if self.tokenizer is None:
            raise ValueError("append_messages needs a tokenizer with a chat template")
        if self._open_turn_start is None:
            raise ValueError(
                "append_messages must follow a model turn (pass all tool/user messages of one gap in one call)"
            )
        d = template_delta(self.tokenizer, self.tools, self.chat_template_kwargs)
        return d.closing_for(self.response_ids[self._open_turn_start:]) + d.messages_delta(messages)

    def append_messages(self, messages: Sequence[Mapping[str, Any]], *, delta: Sequence[int] | None = None) -> list[int]:
        """Append tool results / user turns as the chat-template delta (mask 0), ending with the
        generation prompt of the next assistant turn. Returns the appended ids."""
        ids = list(delta) if delta is not None else self.delta_for(messages)
        self._extend_fixed(ids)
        self._open_turn_start = None
        self.messages.extend(dict(m) for m in messages)
        return ids

    def add_display_message(self, message: Mapping[str, Any], *, replace_last: bool = False) -> None:
        """Record a readable message (e.g. the decoded assistant turn) without touching tokens."""
        if replace_last and self.messages:
            self.messages[-1] = dict(message)
        else:
            self.messages.append(dict(message))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ids, for parsing and display only (never re-encoded)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ trajectories
    def to_trajectory(
        self,
        uid: str,
        group_id: str = "",
        *,
        status: TrajectoryStatus = "completed",
        finish_reason: str = "",
        **fields: Any,
    ) -> Trajectory:
        """A `Trajectory` holding (copies of) this buffer's tokens, turns and messages."""
        versions = [t.weight_version for t in self.turns if t.weight_version]
        traj = Trajectory(
            uid=uid,
            group_id=group_id,
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            response_mask=list(self.response_mask),
            response_logprobs=list(self.response_logprobs),
            weight_version=versions[-1] if versions else "",
            status=status,
            finish_reason=finish_reason,
            messages=[dict(m) for m in self.messages],
            turns=list(self.turns),
            **fields,
        )
        return traj

    @classmethod
    def from_trajectory(
        cls,
        trajectory: Trajectory,
        tokenizer: Any,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> "TokenBuffer":
        """Resume (partial rollout): the buffer holds the trajectory's tokens verbatim; if it ended
        inside a model turn (aborted mid-generation), that assistant message stays open so the next
        generate continues it."""
        trajectory.check_invariants()
        buf = cls(tokenizer, (), tools, prompt_ids=trajectory.prompt_ids, chat_template_kwargs=chat_template_kwargs)
        buf.response_ids = list(trajectory.response_ids)
        buf.response_mask = list(trajectory.response_mask)
        buf.response_logprobs = list(trajectory.response_logprobs)
        buf.turns = list(trajectory.turns)
        buf.messages = [dict(m) for m in trajectory.messages]
        if buf.response_mask and buf.response_mask[-1] == 1:
            # The trailing mask-1 run is the open assistant message (turns only touch when a
            # continuation follows an abort, so the run is exactly that message).
            i = len(buf.response_mask)
            while i > 0 and buf.response_mask[i - 1] == 1:
                i -= 1
            buf._open_turn_start = i
        return buf
