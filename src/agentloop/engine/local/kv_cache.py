"""The decode batch's KV cache: one left-padded tensor pair per layer for all running requests.

Continuous batching needs requests of different lengths to share one forward pass. The cache keeps
all running rows left-padded to a common length P (`keys[l]`, `values[l]`: [B, kv_heads, P, dim])
with a 2-D attention mask [B, P] (0 on padding), which is exactly what a transformers causal LM
accepts with explicit `position_ids`. In steady state a decode step appends in place (no copying);
only when the batch changes (requests join after their prefill, or finish/abort) are rows re-padded
and concatenated (`merge`) or selected (`keep`), and the common left padding trimmed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache


@dataclass
class BatchKV:
    """Left-padded KV cache of the running batch; row i belongs to the i-th running request."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    mask: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.long))

    @property
    def batch_size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def padded_len(self) -> int:
        return int(self.mask.shape[1])

    def real_lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def as_dynamic_cache(self) -> DynamicCache:
        return DynamicCache(ddp_cache_data=list(zip(self.keys, self.values)))

    def absorb(self, cache: DynamicCache) -> None:
        """Take the layers back from a cache the model appended one position to."""
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]
        ones = torch.ones(self.batch_size, 1, dtype=self.mask.dtype)
        self.mask = torch.cat([self.mask, ones], dim=1)

    @classmethod
    def from_cache(cls, cache: DynamicCache, mask: torch.Tensor) -> "BatchKV":
        """Wrap a (left-padded) prefill cache and its [B, P] attention mask."""
        return cls(keys=[layer.keys for layer in cache.layers], values=[layer.values for layer in cache.layers], mask=mask)

    def merge(self, other: "BatchKV") -> None:
        """Append `other`'s rows after ours, re-padding the shorter side on the left."""
        if other.batch_size == 0:
            return
        if self.batch_size == 0:
            self.keys, self.values, self.mask = other.keys, other.values, other.mask
            return
        target = max(self.padded_len, other.padded_len)
        self.keys = [torch.cat([_lpad(a, target), _lpad(b, target)], dim=0) for a, b in zip(self.keys, other.keys)]
        self.values = [torch.cat([_lpad(a, target), _lpad(b, target)], dim=0) for a, b in zip(self.values, other.values)]
        self.mask = torch.cat([_lpad(self.mask, target), _lpad(other.mask, target)], dim=0)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order) and trim padding no remaining row needs."""
        if not rows:
            self.clear()
            return
        index = torch.tensor(rows, dtype=torch.long)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.mask = self.mask.index_select(0, index)
        drop = int(self.padded_len - self.real_lengths().max().item())
        if drop > 0:
            self.keys = [k[:, :, drop:] for k in self.keys]
            self.values = [v[:, :, drop:] for v in self.values]
            self.mask = self.mask[:, drop:]

    def clear(self) -> None:
        self.keys, self.values = [], []
        self.mask = torch.zeros(0, 0, dtype=torch.long)


def _lpad(t: torch.Tensor, target: int) -> torch.Tensor:
    """Left-pad a [B, heads, P, dim] cache tensor (dim=2) or a [B, P] mask (dim=1) with zeros to `target`."""
    pad = target - t.shape[-2 if t.dim() == 4 else -1]
    return t if pad == 0 else F.pad(t, (0, 0, pad, 0) if t.dim() == 4 else (pad, 0))
