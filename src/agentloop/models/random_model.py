"""Tiny random-weight HF causal LMs for tests and benchmarks (no model hub needed).

`make_random_model` writes a complete Hugging Face model folder — `config.json`,
`model.safetensors`, `generation_config.json` — plus a tokenizer (`tokenizer.json`,
`tokenizer_config.json` with a Qwen-style chat template). The folder loads with
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`, with the CPU reference
engine (`agentloop serve --model DIR`) and with SGLang (`--load-format dummy` or real weights).

The same arguments always give the same folder contents (weights are drawn from a seeded
generator), so tests can compare outputs across processes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

#: Special tokens of the built-in tokenizer, in id order right after the byte-level vocabulary.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: A Qwen-style ChatML template (roles wrapped in <|im_start|> ... <|im_end|>).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A little text so the byte-level BPE learns some merges: the vocabulary then looks like a real
# tokenizer's (multi-byte tokens) while staying a few hundred entries long.
_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "You are a helpful assistant. Call the calculator tool when you need arithmetic.",
    "user assistant system tool function arguments result",
    '{"name": "calculator", "arguments": {"expression": "3 * 7"}}',
    "0123456789 + - * / = ( ) [ ] { } , . : ; ? !",
]


def _build_tokenizer(out_dir: Path, vocab_target: int) -> None:
    """Train a small byte-level BPE tokenizer and save it with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING_TEXT * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def make_random_model(
    out_dir: str | Path,
    *,
    arch: Literal["qwen2", "llama"] = "qwen2",
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write a tiny random-weight causal LM folder at `out_dir` and return its path.

    `vocab_size=None` sizes the embedding to the tokenizer; a larger value pads the vocabulary
    (like Qwen's checkpoints); a smaller one is an error. `tokenizer_from` copies an existing
    folder's tokenizer files instead of building the small byte-level one.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, Qwen2Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if arch not in ("qwen2", "llama"):
        raise ValueError(f"make_random_model: arch must be 'qwen2' or 'llama', got {arch!r}")
    if hidden_size % 16 != 0:
        raise ValueError(f"make_random_model: hidden_size must be a multiple of 16, got {hidden_size}")

    if tokenizer_from is not None:
        src = Path(tokenizer_from)
        if not (src / "tokenizer.json").is_file():
            raise FileNotFoundError(f"make_random_model: no tokenizer.json in tokenizer_from={src}")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json"):
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
    else:
        _build_tokenizer(out, vocab_target=320)

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tok_vocab = len(tokenizer)
    model_vocab = tok_vocab if vocab_size is None else int(vocab_size)
    if model_vocab < tok_vocab:
        raise ValueError(f"make_random_model: vocab_size={model_vocab} is smaller than the tokenizer's {tok_vocab}")

    def _tid(name: str) -> int | None:
        tid = tokenizer.convert_tokens_to_ids(name)
        return tid if isinstance(tid, int) and tid >= 0 and tid != tokenizer.unk_token_id else None

    im_end, eot = _tid("<|im_end|>"), _tid("<|endoftext|>")
    eos_ids = [t for t in (im_end, eot) if t is not None] or [tokenizer.eos_token_id or 0]
    heads = max(1, hidden_size // 16)
    kv_heads = heads // 2 if heads % 2 == 0 else heads
    common = dict(
        vocab_size=model_vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        # Larger than HF's 0.02 so logits are peaked enough that greedy decoding is not decided
        # by rounding noise (tests compare batched and unbatched greedy outputs).
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_ids[-1],
        pad_token_id=eot if eot is not None else 0,
    )
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Draw every parameter from our own seeded generator so the result does not depend on
        # transformers' init order; norms stay at one so activations are well scaled.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * common["initializer_range"])
    model.save_pretrained(str(out))
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=common["pad_token_id"], bos_token_id=None).save_pretrained(str(out))
    return out
