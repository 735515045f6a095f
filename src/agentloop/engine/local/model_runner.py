"""Forward passes of a transformers causal LM on CPU: prefill one request, decode the whole batch.

`ModelRunner` loads any HF-format causal LM folder (float32, SDPA attention) and exposes two
forward passes, both under `torch.inference_mode`:
- `prefill_batch(seqs)`: the requests being admitted, each with its whole known sequence (prompt,
  plus tokens already generated when a retracted request comes back), left-padded into one forward
  → float32 logits of the last position (or of every position when prompt logprobs are asked for),
  the padded `DynamicCache` and its attention mask. `prefill(tokens)` is the one-sequence case.
- `decode(kv, last_tokens)`: one new token for every running row at once, using the left-padded
  `BatchKV` with its attention mask and per-row `position_ids`, so the batch's outputs equal the
  rows' unbatched forward passes up to float rounding.
It holds no scheduling state; the scheduler calls it from its worker thread only.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from .kv_cache import BatchKV


class ModelRunner:
    """Owns the `nn.Module` and runs its forward passes."""

    def __init__(self, model_dir: str | Path, *, num_threads: int | None = None) -> None:
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"--model {self.model_dir}: no config.json (need a Hugging Face model folder)")
        if num_threads:
            torch.set_num_threads(num_threads)
        self.config = AutoConfig.from_pretrained(str(self.model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(
            str(self.model_dir), dtype=torch.float32, attn_implementation="sdpa"
        )
        self.model.eval()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.eos_token_ids = self._eos_ids()
        # transformers 5.x renamed `past_key_values` to `cache`; the cache object is updated in
        # place either way, so only the keyword differs.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def _eos_ids(self) -> list[int]:
        """EOS ids from generation_config.json and config.json (SGLang reads both)."""
        ids: list[int] = []
        gen_path = self.model_dir / "generation_config.json"
        sources = [getattr(self.config, "eos_token_id", None)]
        if gen_path.is_file():
            sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
        for src in sources:
            for t in (src if isinstance(src, list) else [src]):
                if isinstance(t, int) and t not in ids:
                    ids.append(t)
        return ids

    @property
    def context_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 4096) or 4096)

    def prefill(self, tokens: list[int], *, all_logits: bool = False) -> tuple[torch.Tensor, DynamicCache]:
        """One sequence: logits ([L, V] if all_logits else [V]) and its unpadded cache."""
        logits, cache, _ = self.prefill_batch([tokens], all_logits=all_logits)
        return (logits[0] if all_logits else logits[0, -1]), cache

    @torch.inference_mode()
    def prefill_batch(
        self, seqs: list[list[int]], *, all_logits: bool = False
    ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """Several sequences at once, left-padded to the longest.

        Returns float32 logits [B, P, V] (all positions) or [B, 1, V] (last position only), the
        cache (rows left-padded like the input) and the [B, P] attention mask.
        """
        longest = max(len(s) for s in seqs)
        input_ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        mask = torch.zeros(len(seqs), longest, dtype=torch.long)
        for i, s in enumerate(seqs):
            input_ids[i, longest - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, longest - len(s):] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
            **{self._cache_kw: cache},
        )
        return out.logits.float(), cache, mask

    @torch.inference_mode()
    def decode(self, kv: BatchKV, last_tokens: list[int]) -> torch.Tensor:
        """Feed each row its last sampled token; append to `kv` in place; return logits [B, V]."""
        positions = kv.real_lengths().unsqueeze(1)  # next position of every row = its real length
        input_ids = torch.tensor(last_tokens, dtype=torch.long).unsqueeze(1)
        mask = torch.cat([kv.mask, torch.ones(kv.batch_size, 1, dtype=kv.mask.dtype)], dim=1)
        cache = kv.as_dynamic_cache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        kv.absorb(cache)
        return out.logits[:, -1].float()
