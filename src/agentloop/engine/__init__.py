"""Engines: the `EngineClient` protocol, the lifecycle gate, the SGLang HTTP client, routing,
server launching, and the CPU reference engine (`local/`)."""

from .base import MEMORY_TAGS, EngineClient, EngineError, EngineUnavailable, GenerateOutput, SamplingParams

__all__ = ["MEMORY_TAGS", "EngineClient", "EngineError", "EngineUnavailable", "GenerateOutput", "SamplingParams"]
