"""What an SGLang client learns about the model a server serves, and the checks it makes with it
before sending: `ServedModel`, one per client (`SGLangClient.served`). It asks the server through the
two reads it is given (`/server_info`, `/model_info`); each lookup is made once and cached here.

Out-of-vocabulary input ids are refused before sending: sglang 0.5.17 defines an input-id vocabulary
check but never calls it, so such an id reaches the embedding lookup of the scheduler. The vocabulary
size comes from `/server_info` (CPU engine) or the served folder's `config.json` when the server
reports a local `model_path` (a server launched on this host); otherwise ids go unchecked.

Tensor weight updates to real SGLang are checked against the served model's parameter names and
shapes (its `config.json` built on the meta device, for a server on this host) before anything is
sent: measured on sglang 0.5.17 (`benchmarks/results/gpu_run1_sglang_dummy.json`), an unknown name is
silently skipped with `success: true` (the trainer's update is lost) and a wrong shape kills the
scheduler. The CPU engine checks both itself and answers 400.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Awaitable, Callable, Literal, Sequence

import anyio

from .base import EngineError
from .weight_payloads import hf_param_shapes

log = logging.getLogger(__name__)

TensorTransport = Literal["auto", "safetensors", "cuda_ipc"]


class ServedModel:
    """Vocabulary size, parameter shapes, tensor transport and TP size of the model one server serves,
    looked up lazily (or up front by `prepare()`), and the pre-send checks that use them.

    `server_info` / `model_info`: the client's reads of `GET /server_info` and `GET /model_info`.
    `tensor_transport` / `vocab_size`: "auto" to look up, or given by the caller.
    """

    def __init__(
        self,
        url: str,
        server_info: Callable[[], Awaitable[dict[str, Any]]],
        model_info: Callable[[], Awaitable[dict[str, Any]]],
        *,
        tensor_transport: TensorTransport = "auto",
        vocab_size: int | None | Literal["auto"] = "auto",
        weight_check: bool = True,
    ) -> None:
        if tensor_transport not in ("auto", "safetensors", "cuda_ipc"):
            raise ValueError(f"tensor_transport must be auto|safetensors|cuda_ipc, not {tensor_transport!r}")
        self.url = url
        self._server_info = server_info
        self._model_info = model_info
        self.tensor_transport: TensorTransport = tensor_transport
        #: "auto" until looked up; then the size, or None when it cannot be known (ids go unchecked)
        self.vocab_size: int | None | Literal["auto"] = vocab_size
        self.weight_check = weight_check
        self.tp_size: int | None = None
        self.param_shapes: dict[str, tuple[int, ...]] | None | Literal["auto"] = "auto"
        self._lookup_lock: anyio.Lock | None = None
        #: The first `/server_info` answer: its launch facts (vocab size, TP size, tensor transport) do not
        #: change while the server runs, so the lookups share one request.
        self._launch_info: dict[str, Any] | None = None

    async def launch_info(self) -> dict[str, Any]:
        if self._launch_info is None:
            self._launch_info = await self._server_info()
        return self._launch_info

    async def resolved_tp_size(self) -> int:
        if self.tp_size is None:
            self.tp_size = int((await self.launch_info()).get("tp_size") or 1)
        return self.tp_size

    async def resolve_vocab_size(self) -> int | None:
        """The model's vocabulary size, looked up once (see module docstring); None if unknowable."""
        if self.vocab_size != "auto":
            return self.vocab_size  # type: ignore[return-value]
        if self._lookup_lock is None:
            self._lookup_lock = anyio.Lock()  # created in the running loop; concurrent first generates ask once
        async with self._lookup_lock:
            if self.vocab_size != "auto":
                return self.vocab_size  # type: ignore[return-value]
            vocab: int | None = None
            try:
                info = await self.launch_info()
                if info.get("vocab_size"):
                    vocab = int(info["vocab_size"])
                else:
                    folder = await self.local_model_folder()
                    if folder is not None:
                        cfg = json.loads((folder / "config.json").read_text())
                        v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
                        vocab = int(v) if v else None
            except (EngineError, OSError, ValueError) as e:
                log.warning("vocab size of %s unknown (%s): input ids go unchecked", self.url, e)
            self.vocab_size = vocab
            return vocab

    async def prepare(self) -> None:
        """Look up now what the first generate / weight update would otherwise look up on its way
        (tensor transport, TP size, vocabulary size, parameter shapes), e.g. while starting up, so
        the first wake-up's timing holds only the update itself. Optional."""
        if await self.resolve_tensor_transport() == "cuda_ipc" and self.weight_check:
            await self.resolve_param_shapes()
        await self.resolve_vocab_size()

    async def local_model_folder(self) -> Path | None:
        """The served model's folder if it is readable here (a server on this host), else None."""
        path = (await self._model_info()).get("model_path")
        folder = Path(str(path)) if path else None
        return folder if folder is not None and (folder / "config.json").is_file() else None

    async def resolve_param_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """HF parameter name → shape of the served model (its config.json on the meta device), or None."""
        if self.param_shapes == "auto":
            shapes: dict[str, tuple[int, ...]] | None = None
            try:
                folder = await self.local_model_folder()
                if folder is not None:
                    shapes = await anyio.to_thread.run_sync(hf_param_shapes, folder)
            except Exception as e:  # noqa: BLE001 - any failure only disables the pre-check
                log.warning("parameter shapes of %s unknown (%s): weight updates go unchecked", self.url, e)
            self.param_shapes = shapes
        return self.param_shapes  # type: ignore[return-value]

    async def check_named_tensors(self, named: Sequence[tuple[str, Any]]) -> None:
        """Refuse (before sending) names the model does not have and shapes that differ from its own."""
        shapes = await self.resolve_param_shapes()
        if not shapes:
            return
        unknown = [n for n, _ in named if n not in shapes]
        if unknown:
            raise EngineError("/update_weights_from_tensor", None,
                              f"refused before sending: {len(unknown)} tensor name(s) the model does not have, e.g. "
                              f"{unknown[:3]} (sglang would skip them silently and report success)", url=self.url)
        for n, t in named:
            if tuple(t.shape) != shapes[n]:
                raise EngineError("/update_weights_from_tensor", None,
                                  f"refused before sending: tensor {n!r} has shape {list(t.shape)}, the model's "
                                  f"parameter has {list(shapes[n])} (sglang's scheduler dies on a mismatch)", url=self.url)

    async def resolve_tensor_transport(self) -> TensorTransport:
        """`safetensors` for the CPU engine, `cuda_ipc` for real SGLang (asked once, then cached)."""
        if self.tensor_transport == "auto":
            info = await self.launch_info()
            self.tp_size = int(info.get("tp_size") or 1)
            self.tensor_transport = "safetensors" if info.get("tensor_transport") == "safetensors" else "cuda_ipc"
        return self.tensor_transport
