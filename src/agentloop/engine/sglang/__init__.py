"""The SGLang HTTP client (`SGLangClient`), for real `sglang.launch_server` and the CPU engine.

- `client.py`: `SGLangClient`, SGLang's endpoints 1:1 (the wire protocol of one server),
- `transport.py`: how its requests travel (one aiohttp session, timeouts, retries, the keep-alive race),
- `error_body.py`: the server's message inside any of SGLang's error bodies.

What the client learns about the served model and checks before sending is `engine/served_model.py`;
weight-update payloads are `engine/weight_payloads.py`.
"""

from .client import SGLangClient
from .error_body import error_message
from .transport import DEFAULT_KEEPALIVE_SECONDS, SGLANG_KEEPALIVE_SECONDS, HttpTransport

__all__ = ["DEFAULT_KEEPALIVE_SECONDS", "SGLANG_KEEPALIVE_SECONDS", "HttpTransport", "SGLangClient", "error_message"]
