"""A deliberately weakened copy of the shipped tiny tool model, for demos that must show learning.

The shipped model answers ~97% of the arithmetic questions right, so GRPO on it sees groups of equal
rewards: zero advantages, zero gradient. `weak_tiny_tool_model()` writes the same model with seeded
Gaussian noise (`noise` x each tensor's std) added to every weight — deterministic for a given
(noise, seed), tokenizer and config unchanged — into a folder (by default one per (noise, seed) under
the system's temp dir, reused when already complete), so a trainer starts from a policy that is right
about half the time and has something to learn. At noise 0.3 (seed 0) the held-out reward is ~0.3-0.5
(`examples/grpo_gpu.py --mode tiny` on the GPU, `examples/grpo_cpu.py` on the CPU).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .tiny import tiny_tool_model

__all__ = ["weak_tiny_tool_model"]

_WEIGHTS = "model.safetensors"


def weak_tiny_tool_model(noise: float = 0.3, seed: int = 0, folder: str | Path | None = None) -> Path:
    """Folder of the shipped tiny tool model with `noise` x std Gaussian noise on every weight.

    `folder`: where to write it (default: `<tmp>/agentloop-weak-tiny-tool-<noise>-<seed>`, reused
    if already written). Usable anywhere a model folder goes (`engine.model`, `from_pretrained`,
    SGLang's `--model-path`)."""
    if not noise >= 0:
        raise ValueError(f"weak_tiny_tool_model: noise must be >= 0, got {noise!r}")
    import torch
    from safetensors.torch import load_file, save_file

    src = tiny_tool_model()
    out = Path(folder) if folder is not None else Path(tempfile.gettempdir()) / f"agentloop-weak-tiny-tool-{noise:g}-{seed}"
    if (out / _WEIGHTS).is_file() and folder is None:
        return out  # written earlier by this function (the weights file is written last, atomically)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != _WEIGHTS:
            shutil.copy2(f, out / f.name)
    g = torch.Generator().manual_seed(seed)
    weights = load_file(str(src / _WEIGHTS))
    # Sorted names: the noise each tensor gets depends only on (seed, name order), not on dict order.
    weak = {k: (v + torch.randn(v.shape, generator=g) * v.float().std() * noise).to(v.dtype).contiguous()
            for k, v in sorted(weights.items())}
    # Written to a temporary name and renamed: a concurrent caller never loads half a file.
    tmp = out / f".{_WEIGHTS}.{os.getpid()}.tmp"
    save_file(weak, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / _WEIGHTS)
    return out
