"""What one request may ask of the CPU engine's server (`agentloop serve --help` lists them): body
bytes by endpoint (small for everything but weight payloads), `n`, and the total tokens of work of one
generate. Kept free of the engine's imports so the command's `--help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestLimits", "WEIGHT_PAYLOAD_PATHS"]

#: Endpoints whose bodies carry weights (serialized tensors); every other body is small.
WEIGHT_PAYLOAD_PATHS = frozenset({"/update_weights_from_tensor"})


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the server (`agentloop serve --help` documents each)."""

    #: Body bytes of any endpoint but the weight-payload ones (a generate body with 128k-token prompts
    #: is a few MB).
    max_request_bytes: int = 16 << 20
    #: Body bytes of `/update_weights_from_tensor` (serialized weights).
    max_weights_request_bytes: int = 1 << 30
    #: Most `sampling_params.n` (parallel samples per input) of one generate.
    max_n: int = 128
    #: Most tokens of work one generate may ask for: over all its samples, prompt tokens + max_new_tokens.
    max_request_tokens: int = 1 << 20
    #: Body bytes held at once over all requests being read or handled (429 past it): concurrent large
    #: bodies cannot add up beyond it (four ~1 GiB weight bodies took the server to 7.7 GB RSS).
    max_held_request_bytes: int = (1 << 30) + (256 << 20)
    #: Seconds a weight update waits for the one in progress (one at a time) before it is refused (409).
    weight_update_wait: float = 30.0

    def body_limit(self, path: str) -> int:
        return self.max_weights_request_bytes if path in WEIGHT_PAYLOAD_PATHS else self.max_request_bytes
