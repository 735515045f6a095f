"""`weak_tiny_tool_model`: the shipped tiny model with seeded noise on every weight — deterministic for a
(noise, seed), different from the shipped weights, the rest of the folder unchanged, a bad noise refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agentloop.models import tiny_tool_model, weak_tiny_tool_model


def test_weak_model_is_seeded_noise_on_the_shipped_weights(tmp_path: Path) -> None:
    a = weak_tiny_tool_model(0.3, 0, folder=tmp_path / "a")
    b = weak_tiny_tool_model(0.3, 0, folder=tmp_path / "b")
    c = weak_tiny_tool_model(0.3, 1, folder=tmp_path / "c")
    shipped = load_file(str(tiny_tool_model() / "model.safetensors"))
    wa, wb, wc = (load_file(str(p / "model.safetensors")) for p in (a, b, c))
    assert wa.keys() == shipped.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # same (noise, seed): same weights
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)  # another seed: other noise
    for k, v in shipped.items():
        assert wa[k].dtype == v.dtype and wa[k].shape == v.shape
        # the noise is 0.3 x the tensor's std (a 0-std tensor, e.g. all-ones norms, is left as is)
        assert float((wa[k] - v).float().std()) == pytest.approx(0.3 * float(v.float().std()), rel=0.2, abs=1e-6)
    assert (a / "tokenizer.json").read_bytes() == (tiny_tool_model() / "tokenizer.json").read_bytes()
    assert not list(a.glob(".*.tmp"))
    default = weak_tiny_tool_model()  # the shared default folder, reused once written
    assert default == weak_tiny_tool_model() and (default / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="noise"):
        weak_tiny_tool_model(-1.0)
