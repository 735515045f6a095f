"""Memory occupation of the CPU engine with SGLang's release/resume semantics.

Tags: `weights`, `kv_cache`, `cuda_graph` (no tags = all). What each does here:
- `weights`: release really frees parameter storage — every parameter's `.data` is replaced by an
  empty tensor, so the bytes go back to the allocator. Resume allocates fresh storage of the right
  shapes filled with zeros: the old values are gone (as with SGLang's torch_memory_saver without
  `--enable-weights-cpu-backup`) until a weight update writes new ones; `weights_valid` says so.
- `kv_cache`: release drops every KV cache the engine holds (the scheduler must be idle, so that is
  the empty batch cache) and forbids allocating new ones until resumed.
- `cuda_graph`: there are no CUDA graphs on CPU; the tag is tracked so that, like SGLang, resuming a
  tag that was not released is an error.
Misuse fails as loudly as SGLang 0.5.17 does, where it kills the server: releasing a tag that is
already released (torch_memory_saver: "Cannot pause allocation that is not active" ends its
scheduler), resuming a tag that is not released (a KeyError in its scheduler), and a generate,
`/health` or `/health_generate` while `weights` or `kv_cache` is released. The CPU engine refuses
each with an error whose message contains `SGLANG_WOULD_CRASH`, changes nothing and keeps serving,
so CPU tests catch what a GPU server punishes. All methods run on the scheduler's worker thread.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")


#: In every refusal of a call that real SGLang does not survive (see the module docstring).
SGLANG_WOULD_CRASH = "real SGLang 0.5.17 would crash here"


class MemoryTagError(ValueError):
    """A release/resume request that cannot be honoured (bad tag, resume of an unreleased tag)."""


def normalize_tags(tags: Sequence[str] | None) -> list[str]:
    """Validate tags; None or [] means all tags (SGLang's default)."""
    if tags is None or len(tags) == 0:
        return list(MEMORY_TAGS)
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise MemoryTagError(f"tags must be a list of strings from {list(MEMORY_TAGS)}, got {tags!r}")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise MemoryTagError(f"unknown memory tag(s) {unknown}; known tags are {list(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags))


class MemoryManager:
    """Tracks which tags are released and frees/re-allocates the model's parameter storage."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.released: set[str] = set()
        # Values are lost on release; they come back only through a weight update.
        self.weights_valid = True
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}

    def _params(self) -> Iterable[tuple[str, nn.Parameter]]:
        # remove_duplicate=True: a tied embedding/lm_head is one Parameter, freed once.
        return self.model.named_parameters(remove_duplicate=True)

    def release(self, tags: Sequence[str] | None) -> list[str]:
        tags = normalize_tags(tags)
        again = [t for t in tags if t in self.released]
        if again:
            raise MemoryTagError(
                f"cannot release tag(s) {again}: already released (released now: {sorted(self.released)}); "
                f"{SGLANG_WOULD_CRASH} (torch_memory_saver: 'Cannot pause allocation that is not active. "
                f"tag={again[0]}' ends its scheduler). Resume them first, or release only resident tags."
            )
        if "weights" in tags:
            for name, p in self._params():
                self._shapes[name] = (p.shape, p.dtype)
                p.data = torch.empty(0, dtype=p.dtype)
            self.weights_valid = False
        self.released.update(tags)
        return tags

    def resume(self, tags: Sequence[str] | None) -> list[str]:
        tags = normalize_tags(tags)
        not_released = [t for t in tags if t not in self.released]
        if not_released:
            raise MemoryTagError(
                f"cannot resume tag(s) {not_released}: not released (released now: {sorted(self.released)}); "
                f"{SGLANG_WOULD_CRASH} (KeyError on the tag in its scheduler). Resume only released tags."
            )
        if "weights" in tags:
            for name, p in self._params():
                shape, dtype = self._shapes[name]
                p.data = torch.zeros(shape, dtype=dtype)
        self.released.difference_update(tags)
        return tags

    def generation_block_reason(self) -> str | None:
        """Why generation is impossible now, or None."""
        blocked = [t for t in ("weights", "kv_cache") if t in self.released]
        if not blocked:
            return None
        return (
            f"memory released ({', '.join(blocked)}): generation is refused until "
            f"/resume_memory_occupation restores {blocked}; {SGLANG_WOULD_CRASH} (a generate, /health or "
            "/health_generate on released memory ends its scheduler)"
        )

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self._params())
