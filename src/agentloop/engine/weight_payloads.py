"""Weight-update payloads and the served model's parameter shapes, for `update_weights_from_tensor`.

Two transports: base64 safetensors bytes for the CPU engine (no pickle on the network), and SGLang's
own `MultiprocessingSerializer` strings (CUDA IPC handles, one per TP rank) for real SGLang, imported
lazily so nothing here needs sglang until it is used. `hf_param_shapes` gives name → shape of a
served HF folder (built on the meta device) so a bad update is refused before it is sent;
`check_finite` refuses NaN/Inf values before they reach an engine.
"""

from __future__ import annotations

import base64
import functools
from pathlib import Path
from typing import Any, Sequence

from .base import EngineError


class NonFiniteWeightsError(ValueError):
    """A weight update holds NaN or Inf values; the message names the first such tensor."""


def _sum_is_finite(t: Any) -> bool:
    import torch

    # float16 sums overflow early (max 65504): accumulate those in float32; the rest in their own
    # dtype (bfloat16 shares float32's range, and its native sum is ~3x faster than a float32 one).
    return bool(torch.isfinite(t.sum(dtype=torch.float32) if t.dtype == torch.float16 else t.sum()))


def check_finite(named_tensors: Sequence[tuple[str, Any]]) -> None:
    """Refuse a weight update holding NaN or Inf, naming the tensor (raises `NonFiniteWeightsError`).

    An engine takes such weights without complaint and then fails every sampled generate (the CPU
    engine answered 500 to each), so they are stopped before they reach one. One float32-accumulated
    sum per floating tensor: NaN or Inf anywhere makes the sum non-finite, and only then (or when a
    finite tensor's sum overflows) is the tensor scanned element by element to say what it holds. Cost,
    measured by `benchmarks/weight_finite_check.py` on 2 CPU cores shared with other work (load
    average 17): 2.8 s per GB of float32 weights, 2.7 s per GB of bfloat16, a sixth of an
    element-wise `isfinite` scan (benchmarks/results/weight_finite_check_cpu.json). Not negligible on
    a CPU, hence `engine.check_finite_weights` (default on). On a GPU it runs where the tensors live;
    `python benchmarks/weight_finite_check.py --device cuda` times it there.
    """
    import torch

    for name, t in named_tensors:
        if not (t.dtype.is_floating_point or t.dtype.is_complex) or t.numel() == 0 or _sum_is_finite(t.detach()):
            continue
        t = t.detach()
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            raise NonFiniteWeightsError(
                f"tensor {name!r} holds {nan} NaN and {inf} Inf value(s) of {t.numel()}: a weight update must be "
                "finite (the engine would take it and then fail every sampled generate)")


@functools.lru_cache(maxsize=8)
def _hf_param_shapes_cached(folder: str, mtime_ns: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return tuple((n, tuple(t.shape)) for n, t in model.state_dict().items())


def hf_param_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor in the state dict of the HF model in `folder` (built on the meta
    device from its config.json: no weights are read). Tied weights appear under both names.
    Cached per process (keyed by the config's mtime): building it takes about a second."""
    cfg = Path(folder) / "config.json"
    return dict(_hf_param_shapes_cached(str(Path(folder).resolve()), cfg.stat().st_mtime_ns))


def safetensors_payload(named_tensors: Sequence[tuple[str, Any]]) -> str:
    """Base64 of `safetensors.torch.save` bytes of the named tensors (the CPU engine's tensor transport)."""
    from safetensors.torch import save

    tensors: dict[str, Any] = {}
    for name, t in named_tensors:
        if name in tensors:
            raise ValueError(f"tensor name {name!r} appears twice in the weight update")
        # safetensors wants dense CPU tensors that own their storage (no shared views).
        tensors[name] = t.detach().to("cpu").contiguous().clone()
    return base64.b64encode(save(tensors)).decode("ascii")


def cuda_ipc_payloads(named_tensors: Sequence[tuple[str, Any]], tp_size: int) -> list[str]:
    """SGLang's own HTTP payloads: one `MultiprocessingSerializer` string per TP rank.

    Each TP rank deserializes only its own copy (`tp_worker._deserialize_own_rank`), so producer-side
    CUDA-IPC refcounts drop cleanly. Tensors must live on a CUDA device of this node; CPU tensors are
    moved to the current device (the caller keeps the list alive until the HTTP call returns).
    """
    import torch
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    # Device UUIDs instead of indices in the IPC handles: the server may see other CUDA_VISIBLE_DEVICES.
    monkey_patch_torch_reductions()
    if not torch.cuda.is_available():
        raise EngineError("/update_weights_from_tensor", None,
                          "CUDA IPC transport needs CUDA tensors but this process has no CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    named = [(n, t.detach().to(dev) if t.device.type != "cuda" else t.detach()) for n, t in named_tensors]
    return [MultiprocessingSerializer.serialize(named, output_str=True) for _ in range(max(1, tp_size))]
