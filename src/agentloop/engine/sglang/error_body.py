"""The human message inside an SGLang error response, whatever its shape.

SGLang's error bodies come in three JSON shapes — `{"error": {"message"}}` from its handlers,
`{"detail": ...}` from FastAPI validation, `{"success": false, "message"}` from weight updates — and
plain text; `error_message` reads any of them, so an `EngineError` can carry the server's own words.
"""

from __future__ import annotations

import json

__all__ = ["error_message"]


def error_message(body: bytes | str) -> str:
    """The human message inside any of SGLang's error bodies (JSON shapes or plain text)."""
    text = body.decode("utf-8", "replace") if isinstance(body, (bytes, bytearray)) else str(body)
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip() or "(empty response body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, (str, list)) and err:
            return err if isinstance(err, str) else "; ".join(map(str, err))
        detail = data.get("detail")
        if isinstance(detail, list):  # FastAPI/pydantic validation errors
            parts = []
            for d in detail:
                if isinstance(d, dict):
                    loc = ".".join(str(x) for x in d.get("loc", ()) if x != "body")
                    parts.append(f"{loc}: {d.get('msg', d)}" if loc else str(d.get("msg", d)))
                else:
                    parts.append(str(d))
            return "; ".join(parts)
        if detail is not None:
            return str(detail)
        if "message" in data:
            return str(data["message"])
    return text.strip()
