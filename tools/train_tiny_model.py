#!/usr/bin/env python
"""Build, train, evaluate and ship agentloop's tiny tool-calling model (issue 3).

The CPU demo must call tools for real, random weights never do, and no model can be downloaded,
so agentloop trains its own: a byte-level BPE tokenizer with Qwen2.5-style chat markup and a
Qwen2ForCausalLM of ~1.5M parameters, trained on synthetic arithmetic tool use
(`agentloop.tasks.arithmetic`): the user asks, the assistant calls the `calculator` tool in the
Hermes format, the tool answers, the assistant says `The answer is N.`.

    python tools/train_tiny_model.py                         # train + evaluate + write the card
    python tools/train_tiny_model.py --eval [--model DIR]    # evaluate a trained folder only

Everything is seeded (data, init, batch order); training runs in about ten minutes on 2 CPU
threads. The evaluation (`evaluate`) is also what `tests/test_tiny_model.py` runs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout: import the package next to it
    sys.path.insert(0, str(REPO))

from agentloop.tasks.arithmetic import (  # noqa: E402
    CALCULATOR_TOOL,
    TOOL_NAME,
    ArithmeticQuestion,
    ExpressionError,
    evaluate_expression,
    extract_final_answer,
    format_result,
    generate_questions,
    reference_messages,
)

DEFAULT_OUT = REPO / "agentloop" / "models" / "tiny_tool"
TRAIN_SEED = 1234  # questions the model is trained on
EVAL_SEED = 20261202  # fresh questions for the evaluation; never used for training data
INIT_SEED = 0  # weights and batch order

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# Control tokens: never split, never produced by normal text.
SPECIAL_TOKENS = [EOT, IM_START, IM_END]
# Markup tokens of tool use: single tokens too, but *not* special (as in Qwen2.5), so that a
# detokenizer with skip_special_tokens=True (SGLang's default) still shows them to the tool parser.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Upper bound: the corpus is so regular that BPE runs out of merges well below it (~590 tokens).
MAX_VOCAB = 1024

# Qwen2.5's template, trimmed of nothing that matters: tools are rendered as JSON lines inside
# <tools></tools> in the system turn; assistant tool calls become <tool_call>\n{json}\n</tool_call>;
# `tool` messages go inside a *user* turn as <tool_response>\n...\n</tool_response> (consecutive
# tool messages share one user turn). `arguments` may be a dict or an already-encoded JSON string.
CHAT_TEMPLATE = (
    "{%- set default_system = 'You are a helpful assistant.' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- default_system }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content + '\\n' }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A few system prompts so the model does not hinge on one exact header.
SYSTEM_PROMPTS = (
    None,
    None,
    None,
    None,
    "You are a helpful assistant.",
    "You are a careful math assistant. Use the calculator tool for arithmetic.",
    "Answer arithmetic questions with the calculator.",
)

# Architecture: Qwen2 with GQA, as small as still learns the copy-heavy task reliably.
MODEL_SHAPE = dict(
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def render(messages: list[dict[str, Any]], *, add_generation_prompt: bool = False, tools=(CALCULATOR_TOOL,)) -> str:
    """Render with the chat template through transformers' own Jinja renderer (used before the
    tokenizer exists; afterwards `apply_chat_template` gives the same string, see the test)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=list(tools) if tools else None,
        chat_template=CHAT_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
    )
    return rendered[0]


def build_tokenizer(corpus: Sequence[str]):
    """Byte-level BPE trained on rendered conversations, with Qwen2's pre-tokenizer (digits split
    one by one, so numbers copy digit by digit) and the chat/tool markup as single tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(
                    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
                ),
                behavior="isolated",
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MAX_VOCAB - len(MARKUP_TOKENS),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no UNK ever
        show_progress=False,
    )
    # Markup tokens must not take part in BPE training: cut them out of the corpus first. A newline
    # in their place keeps word boundaries as the pre-tokenizer will see them ("system", not " system").
    strip = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + MARKUP_TOKENS))
    tok.train_from_iterator((strip.sub("\n", text) for text in corpus), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOT,
        unk_token=None,
        bos_token=None,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tokenizer(hf_tok, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json, with the chat template *inside* tokenizer_config.json
    (readable by every transformers version and by SGLang) rather than in a separate .jinja file."""
    hf_tok.save_pretrained(str(out))
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# Training data
# ---------------------------------------------------------------------------------------------


def conversation(q: ArithmeticQuestion, rng: random.Random) -> list[dict[str, Any]]:
    return reference_messages(q, system=rng.choice(SYSTEM_PROMPTS))


def encode_for_training(hf_tok, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and a mask that is 1 exactly on assistant-produced
    tokens: each assistant turn's content through its `<|im_end|>` (not the template's "\\n")."""
    ids: list[int] = []
    mask: list[int] = []
    done = 0  # characters of the full rendering already encoded
    full = render(messages)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:i], add_generation_prompt=True))
        end = len(render(messages[: i + 1]))
        turn = full[start:end]
        assert turn.endswith(IM_END + "\n"), turn
        for text, bit in ((full[done:start], 0), (turn[:-1], 1)):
            piece = hf_tok.encode(text, add_special_tokens=False)
            ids += piece
            mask += [bit] * len(piece)
        done = end - 1
    piece = hf_tok.encode(full[done:], add_special_tokens=False)
    ids += piece
    mask += [0] * len(piece)
    return ids, mask


def build_dataset(hf_tok, questions: Sequence[ArithmeticQuestion], seed: int):
    rng = random.Random(seed)
    data = []
    for n, q in enumerate(questions):
        msgs = conversation(q, rng)
        ids, mask = encode_for_training(hf_tok, msgs)
        if n < 64:  # piecewise encoding must equal encoding the whole text (what inference sees)
            assert ids == hf_tok.encode(render(msgs), add_special_tokens=False), q
        data.append((ids, mask))
    return data


def batches(data, batch_size: int, rng: random.Random):
    """Length-bucketed batches (less padding), in a seeded random order; yields forever."""
    while True:
        order = sorted(range(len(data)), key=lambda i: (len(data[i][0]), rng.random()))
        chunks = [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            width = max(len(data[i][0]) for i in chunk)
            input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
            attn = torch.zeros(len(chunk), width, dtype=torch.long)
            labels = torch.full((len(chunk), width), -100, dtype=torch.long)
            for row, i in enumerate(chunk):
                ids, mask = data[i]
                t = torch.tensor(ids)
                input_ids[row, : len(ids)] = t
                attn[row, : len(ids)] = 1
                labels[row, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), t, -100)
            yield input_ids, attn, labels


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


def make_config(hf_tok):
    from transformers import Qwen2Config

    return Qwen2Config(
        # Exactly the tokenizer's size: no untrained ids a sampler could draw and not decode.
        vocab_size=len(hf_tok),
        hidden_act="silu",
        use_sliding_window=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        eos_token_id=hf_tok.convert_tokens_to_ids(IM_END),
        bos_token_id=hf_tok.convert_tokens_to_ids(EOT),
        pad_token_id=hf_tok.convert_tokens_to_ids(EOT),
        **MODEL_SHAPE,
    )


def save_model(model, hf_tok, out: Path) -> None:
    from transformers import GenerationConfig

    model.save_pretrained(str(out), safe_serialization=True)
    eos = hf_tok.convert_tokens_to_ids(IM_END)
    pad = hf_tok.convert_tokens_to_ids(EOT)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=pad, do_sample=False).save_pretrained(str(out))
    # Spell out the classic keys too, so readers that predate transformers 5 (older SGLang,
    # vLLM) see the same rope and dtype as transformers 5 does.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", MODEL_SHAPE["rope_theta"])
    cfg.setdefault("torch_dtype", "float32")
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def train(args) -> dict[str, Any]:
    from transformers import Qwen2ForCausalLM

    torch.set_num_threads(args.threads)
    random.seed(INIT_SEED)
    torch.manual_seed(INIT_SEED)
    t0 = time.time()

    questions = generate_questions(args.train_questions, TRAIN_SEED)
    corpus_rng = random.Random(TRAIN_SEED + 1)
    corpus = [render(conversation(q, corpus_rng)) for q in questions[:3000]]
    hf_tok = wrap_tokenizer(build_tokenizer(corpus))
    data = build_dataset(hf_tok, questions, TRAIN_SEED + 2)
    lengths = [len(ids) for ids, _ in data]
    print(f"data: {len(data)} conversations, {sum(lengths)} tokens, length {min(lengths)}..{max(lengths)}, "
          f"built in {time.time() - t0:.0f}s", flush=True)

    model = Qwen2ForCausalLM(make_config(hf_tok))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    stream = batches(data, args.batch_size, random.Random(INIT_SEED))
    t_train = time.time()
    seen_tokens = 0
    for step in range(args.steps):
        input_ids, attn, labels = next(stream)
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        seen_tokens += int(attn.sum())
        if step % 50 == 0 or step == args.steps - 1:
            el = time.time() - t_train
            print(f"step {step:5d} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{seen_tokens / max(el, 1e-9):.0f} tok/s {el:.0f}s", flush=True)
    train_seconds = time.time() - t_train

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    save_tokenizer(hf_tok, out)
    save_model(model, hf_tok, out)
    return {
        "parameters": n_params,
        "train_seconds": round(train_seconds, 1),
        "train_conversations": len(data),
        "train_tokens_seen": seen_tokens,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "threads": args.threads,
    }


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_hermes_calls(text: str) -> list[dict[str, Any]] | None:
    """Hermes tool calls in a model turn as [{"name", "arguments"}], [] if it has none, None if a
    `<tool_call>` block is not valid JSON of that shape. Evaluation-only: the runtime uses
    `agentloop.tools.parsers`."""
    calls = []
    for body in _TOOL_CALL_RE.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
            return None
        calls.append({"name": obj["name"], "arguments": obj["arguments"]})
    if not calls and "<tool_call>" in text:
        return None
    return calls


def _calculator(arguments: dict[str, Any]) -> str:
    try:
        return format_result(evaluate_expression(arguments.get("expression")))
    except ExpressionError as e:
        return f"Error: {e}"


@torch.no_grad()
def _generate(model, hf_tok, prompts: list[str], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy, KV-cached, left-padded batched generation; returns each completion's text."""
    outs: list[str] = []
    for i in range(0, len(prompts), batch_size):
        enc = hf_tok(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=hf_tok.eos_token_id,
            pad_token_id=hf_tok.pad_token_id,
        )
        for row in gen[:, enc["input_ids"].shape[1] :]:
            text = hf_tok.decode(row.tolist(), skip_special_tokens=False)
            outs.append(text.split(IM_END)[0].replace(EOT, ""))
    return outs


def evaluate(
    model_dir: str | Path,
    n: int = 200,
    seed: int = EVAL_SEED,
    *,
    max_turns: int = 4,
    batch_size: int = 100,
    parse_calls: Callable[[str], list[dict[str, Any]] | None] = parse_hermes_calls,
) -> dict[str, Any]:
    """Run the agent loop with greedy decoding on `n` fresh questions.

    Returns fractions: `tool_call_accuracy` (the first turn holds a parsable calculator call whose
    expression evaluates to the value of the first expected call), `final_answer_accuracy` (the
    conversation ends with `The answer is <right value>.` after making exactly the expected number
    of calls, all executed by the real calculator), and the same split by single/multi-call.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf_tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    questions = generate_questions(n, seed)
    convs = [[{"role": "user", "content": q.question}] for q in questions]
    first_ok = [False] * n
    calls_made = [0] * n
    final: list[str | None] = [None] * n
    active = list(range(n))
    t0 = time.time()
    for turn in range(max_turns):
        if not active:
            break
        prompts = [
            hf_tok.apply_chat_template(convs[i], tools=[CALCULATOR_TOOL], add_generation_prompt=True, tokenize=False)
            for i in active
        ]
        texts = _generate(model, hf_tok, prompts, max_new_tokens=64, batch_size=batch_size)
        still = []
        for i, text in zip(active, texts):
            calls = parse_calls(text)
            if calls is None:  # malformed call: the conversation fails here
                continue
            if turn == 0 and len(calls) == 1 and calls[0]["name"] == TOOL_NAME:
                try:
                    first_ok[i] = evaluate_expression(calls[0]["arguments"].get("expression")) == evaluate_expression(
                        questions[i].expression
                    )
                except ExpressionError:
                    pass
            if not calls:
                convs[i].append({"role": "assistant", "content": text})
                final[i] = text
                continue
            calls_made[i] += len(calls)
            convs[i].append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": c} for c in calls],
                }
            )
            for c in calls:
                result = _calculator(c["arguments"]) if c["name"] == TOOL_NAME else f"Error: unknown tool {c['name']}"
                convs[i].append({"role": "tool", "name": c["name"], "content": result})
            still.append(i)
        active = still
    final_ok = [
        final[i] is not None and extract_final_answer(final[i]) == q.answer and calls_made[i] == q.num_calls
        for i, q in enumerate(questions)
    ]
    multi = [i for i, q in enumerate(questions) if q.num_calls > 1]
    single = [i for i, q in enumerate(questions) if q.num_calls == 1]

    def frac(flags, idx):
        return round(sum(flags[i] for i in idx) / max(1, len(idx)), 4)

    failures = [
        {"question": questions[i].question, "expected": questions[i].expected_calls(), "conversation": convs[i][1:]}
        for i in range(n)
        if not final_ok[i]
    ]
    return {
        "n": n,
        "seed": seed,
        "tool_call_accuracy": frac(first_ok, range(n)),
        "final_answer_accuracy": frac(final_ok, range(n)),
        "single_call": {"n": len(single), "final_answer_accuracy": frac(final_ok, single)},
        "multi_call": {"n": len(multi), "final_answer_accuracy": frac(final_ok, multi)},
        "eval_seconds": round(time.time() - t0, 1),
        "failures": failures[:5],
    }


# ---------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------


def write_card(out: Path, train_info: dict[str, Any], ev: dict[str, Any], command: str) -> None:
    cfg = json.loads((out / "config.json").read_text())
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    card = f"""# tiny_tool — agentloop's tiny tool-calling model

A {train_info['parameters'] / 1e6:.2f}M-parameter Qwen2 causal LM that answers integer arithmetic
questions by calling a `calculator` tool, trained from scratch on CPU by `tools/train_tiny_model.py`.
It exists so the CPU demo and the tests run real multi-turn tool calling with no download.
Not a general model: outside the task it produces nonsense.

## Architecture
`Qwen2ForCausalLM` (loads in transformers and SGLang): hidden {cfg['hidden_size']},
{cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} attention heads / {cfg['num_key_value_heads']} KV heads
(head dim {cfg['hidden_size'] // cfg['num_attention_heads']}), MLP {cfg['intermediate_size']}, vocab {cfg['vocab_size']},
RoPE theta {cfg.get('rope_theta', MODEL_SHAPE['rope_theta'])}, max positions {cfg['max_position_embeddings']},
tied embeddings, float32 weights: `model.safetensors` is {size_mb:.1f} MB.

## Tokenizer and chat format
Byte-level BPE (HF `tokenizers`, Qwen2 pre-tokenizer: digits are single tokens) trained on the
synthetic conversations. `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are special tokens;
`<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` are single non-special added
tokens (as in Qwen2.5), so they survive `skip_special_tokens=True` detokenization. EOS / end of
turn is `<|im_end|>` (config.json and generation_config.json); padding is `<|endoftext|>`.

The chat template (in `tokenizer_config.json`) is Qwen2.5-style:
- `tools=[...]` (OpenAI function schemas) are listed as JSON lines in `<tools></tools>` in the
  system turn; without a system message the system text is `You are a helpful assistant.`
- an assistant message with `tool_calls` renders each call as
  `<tool_call>\\n{{"name": "calculator", "arguments": {{"expression": "12 + 5"}}}}\\n</tool_call>`
  (Hermes format; `arguments` may be a dict or a JSON string);
- a `tool` message renders inside a **user** turn as `<tool_response>\\n...\\n</tool_response>`
  (consecutive tool messages share one user turn), like Qwen2.5;
- `add_generation_prompt=True` appends `<|im_start|>assistant\\n`.

## Training data (`agentloop.tasks.arithmetic`)
{train_info['train_conversations']} conversations from seed {TRAIN_SEED}: the user asks for arithmetic
on integers of 1 to 3 digits with `+ - *`, one to three operations, in phrasings such as "What is",
"Compute", "Calculate", "How much is", "Evaluate", with operators as symbols or words
("plus", "minus", "times", "multiplied by"). The assistant calls
`calculator` with the expression (`"12 + 34 * 5"`), the tool returns the value, the assistant says
`The answer is N.`. 30% of the questions chain a second step ("Compute 12 + 5 and then multiply the
result by 7."): the second call uses the first call's result. The tool schema is
`agentloop.tasks.arithmetic.CALCULATOR_TOOL`; some conversations carry one of a few system prompts.
Loss is on assistant tokens only (tool calls, final answer, their `<|im_end|>`).

Optimisation: AdamW (lr {train_info['lr']}, betas 0.9/0.98, weight decay 0.01), 5% warm-up then
cosine, batch {train_info['batch_size']} conversations, {train_info['steps']} steps
({train_info['train_tokens_seen'] / 1e6:.1f}M tokens), {train_info['train_seconds'] / 60:.1f} minutes on
{train_info['threads']} CPU threads. Seeds: data {TRAIN_SEED}, weights and batch order {INIT_SEED}.

## Measured accuracy
Greedy decoding with transformers on {ev['n']} fresh questions (seed {ev['seed']}, never used in
training), the calculator executed for real and its result appended each turn:

| metric | value |
| --- | --- |
| first turn is a parsable calculator call with the right value | {ev['tool_call_accuracy']:.1%} |
| right final answer (and every needed call made) | {ev['final_answer_accuracy']:.1%} |
| — single-call questions ({ev['single_call']['n']}) | {ev['single_call']['final_answer_accuracy']:.1%} |
| — two-call questions ({ev['multi_call']['n']}) | {ev['multi_call']['final_answer_accuracy']:.1%} |

`tests/test_tiny_model.py` re-measures this and asserts >= 90% and >= 80%.

## Reproduce
```
{command}
python tools/train_tiny_model.py --eval
```

## Use
```python
from agentloop.models import tiny_tool_model
from transformers import AutoModelForCausalLM, AutoTokenizer
path = tiny_tool_model()
tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
```
"""
    (out / "MODEL_CARD.md").write_text(card)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="model folder to write (default: the shipped one)")
    p.add_argument("--eval", action="store_true", help="only evaluate an existing folder (--model)")
    p.add_argument("--model", default=None, help="folder to evaluate (default: --out)")
    p.add_argument("--eval-n", type=int, default=200)
    p.add_argument("--eval-seed", type=int, default=EVAL_SEED)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--train-questions", type=int, default=40000)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.eval_seed == TRAIN_SEED:
        p.error("--eval-seed must differ from the training seed")
    if args.eval:
        ev = evaluate(args.model or args.out, n=args.eval_n, seed=args.eval_seed)
        print(json.dumps(ev, indent=2))
        return 0
    info = train(args)
    print(json.dumps(info), flush=True)
    ev = evaluate(args.out, n=args.eval_n, seed=args.eval_seed)
    print(json.dumps(ev, indent=2), flush=True)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    write_card(Path(args.out), info, ev, f"python tools/train_tiny_model.py {argv_text}".strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
