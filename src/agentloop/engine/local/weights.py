"""Weight updates of the CPU engine: read named tensors from disk or from an HTTP payload, check
them against the model, copy them in.

Sources:
- `read_disk(model_path)`: a safetensors file or an HF folder (every `*.safetensors` in it).
- `read_tensor_payloads(serialized_named_tensors)`: SGLang's `/update_weights_from_tensor` body
  field, where for this engine each element is a **base64 string of safetensors bytes**
  (`safetensors.torch.save(dict)`). Nothing else is accepted — in particular no pickle, which
  would run code from the network. SGLang sends one payload per TP rank; the CPU engine has one
  rank, so every payload is applied (they are normally one).
`apply(model, tensors)` checks every name, shape and value (NaN/Inf refused) before writing
anything (all or nothing), so a bad update leaves the model as it was and the error names the first
offending tensor. Names follow the model's own `named_parameters()` (HF checkpoint names); a tied
`lm_head.weight` is accepted.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import load_file as st_load_file
from torch import nn

from ..weight_payloads import NonFiniteWeightsError, check_finite


class WeightUpdateError(ValueError):
    """A weight update that cannot be applied; the message names the tensor or payload at fault."""


def read_disk(model_path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(model_path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightUpdateError(f"model_path {path}: no *.safetensors files in the folder")
    else:
        raise WeightUpdateError(f"model_path {path}: no such file or folder")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(st_load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise WeightUpdateError(f"model_path {f}: not a readable safetensors file ({e})") from e
    return tensors


def read_tensor_payloads(payloads: Any) -> dict[str, torch.Tensor]:
    if isinstance(payloads, str):
        payloads = [payloads]
    if not isinstance(payloads, list) or not payloads:
        raise WeightUpdateError("serialized_named_tensors must be a non-empty list of base64 safetensors payloads")
    tensors: dict[str, torch.Tensor] = {}
    for i, item in enumerate(payloads):
        if not isinstance(item, str):
            raise WeightUpdateError(
                f"serialized_named_tensors[{i}]: only safetensors payloads (base64 strings) are accepted, got {type(item).__name__}"
            )
        try:
            raw = base64.b64decode(item, validate=True)
            tensors.update(st_load(raw))
        except (binascii.Error, ValueError, SafetensorError) as e:
            raise WeightUpdateError(
                f"serialized_named_tensors[{i}]: only safetensors payloads are accepted "
                f"(base64 of safetensors.torch.save bytes); could not read it: {e}"
            ) from e
    return tensors


def apply(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> int:
    """Check all names/shapes, then copy every tensor into its parameter. Returns how many."""
    if not tensors:
        raise WeightUpdateError("the update holds no tensors")
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in tensors.items():
        p = params.get(name)
        if p is None:
            raise WeightUpdateError(f"tensor {name!r} does not match any parameter of the model")
        if tuple(t.shape) != tuple(p.shape):
            raise WeightUpdateError(f"tensor {name!r} has shape {list(t.shape)}, the model's parameter has {list(p.shape)}")
        if not (t.dtype.is_floating_point or t.dtype == p.dtype):
            raise WeightUpdateError(f"tensor {name!r} has dtype {t.dtype}, the model's parameter is {p.dtype}")
    try:
        check_finite(tensors.items())
    except NonFiniteWeightsError as e:
        raise WeightUpdateError(str(e)) from None
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t.to(params[name].dtype))
    return len(tensors)

