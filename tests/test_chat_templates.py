"""Small tokenizers with real-world chat templates (Qwen2.5-style and Llama-3.1-style), built here
with `tokenizers`, for the token-buffer property tests; plus checks that they behave like the originals.

Both are byte-level BPE tokenizers (any text encodes) whose special tokens are single ids, with the
chat templates of the model families (default system prompt injection, tools in the system prompt,
`content | trim`, grouped tool responses), so the buffer's delta logic meets the same shapes it
meets on real models.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: 26 Jul 2024\\n\\n" }}
{%- if tools %}
    {{- "You have access to the following functions. To call a function, respond with JSON.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role in ['ipython', 'tool'] %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content | trim }}
        {{- "<|eot_id|>" }}
    {%- elif message.tool_calls %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

_CORPUS = [
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
    "system user assistant tool ipython <tools></tools> <tool_call></tool_call> <tool_response></tool_response>",
    '{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}} {"type": "function"}',
    "What is 17 + 25? The answer is 42. Let me compute 3 * 14 with the calculator tool.",
    "the quick brown fox jumps over the lazy dog 0123456789 +-*/=()[]{}<>:;,.!? \n\t",
]


def _bpe(specials: list[str], vocab_size: int = 600) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    return tok


@functools.lru_cache(maxsize=None)
def qwen_style_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    t = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(specials), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    t.chat_template = QWEN_TEMPLATE
    return t


@functools.lru_cache(maxsize=None)
def llama3_style_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    t = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(specials), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
    )
    t.chat_template = LLAMA3_TEMPLATE
    return t


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def test_qwen_style_template_injects_system_prompt_and_groups_tool_responses() -> None:
    t = qwen_style_tokenizer()
    text = t.apply_chat_template(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "x"},
            {"role": "tool", "content": "1"},
            {"role": "tool", "content": "2"},
        ],
        tools=TOOLS, add_generation_prompt=True, tokenize=False,
    )
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert '"name": "calculator"' in text
    assert text.count("<|im_start|>user") == 2  # the two tool results share one user block
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    ids = t.encode(text, add_special_tokens=False)
    assert ids.count(t.convert_tokens_to_ids("<|im_end|>")) == 4
    assert t.decode(ids) == text


def test_llama3_style_template_trims_and_adds_bos() -> None:
    t = llama3_style_tokenizer()
    text = t.apply_chat_template(
        [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "ok"}, {"role": "tool", "content": " 7 "}],
        add_generation_prompt=True, tokenize=False,
    )
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge")
    assert "<|end_header_id|>\n\nhi<|eot_id|>" in text
    assert "ipython<|end_header_id|>\n\n7<|eot_id|>" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = t.encode(text, add_special_tokens=False)
    assert ids[0] == t.bos_token_id and ids.count(t.bos_token_id) == 1
