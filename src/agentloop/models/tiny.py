"""The shipped tiny tool-calling model's folder (see MODEL_CARD.md in it)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["tiny_tool_model"]

_TINY_TOOL_DIR = Path(__file__).resolve().parent / "tiny_tool"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def tiny_tool_model() -> Path:
    """Folder of the shipped tiny tool-calling model (HF format, LlamaForCausalLM, Qwen2.5-style chat).

    Pass it anywhere a model path goes: `AutoModelForCausalLM.from_pretrained`, `agentloop serve`,
    SGLang's `--model-path`. Raises FileNotFoundError naming the missing files if the package was
    installed without its data.
    """
    missing = [name for name in _REQUIRED if not (_TINY_TOOL_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"tiny tool model incomplete at {_TINY_TOOL_DIR}: missing {', '.join(missing)} "
            "(package data not installed? rebuild with `python tools/train_tiny_model.py`)"
        )
    return _TINY_TOOL_DIR
