"""The shipped tiny tool-calling model and the arithmetic task it was trained on.

Covers: the task module (evaluator, generator, chained calls, answer extraction), the model folder
(found as package data, a stock Llama config, EOS = <|im_end|>), the tokenizer and chat template as
transformers renders them (tools, Hermes tool calls, tool role, generation prompt), and the measured
accuracy with greedy decoding on 200 fresh questions (thresholds of issue 3).
"""

from __future__ import annotations

import importlib.util
import json
import random
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop.models import tiny_tool_model
from agentloop.tasks.arithmetic import (
    CALCULATOR_TOOL,
    ArithmeticQuestion,
    ExpressionError,
    FollowUp,
    evaluate_expression,
    extract_final_answer,
    generate_questions,
    is_correct,
    reference_messages,
)

REPO = Path(__file__).resolve().parents[1]


def _load_training_script():
    spec = importlib.util.spec_from_file_location("train_tiny_model", REPO / "tools" / "train_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """CI cores are shared: one torch thread is the fast setting there (two waited at barriers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def script():
    return _load_training_script()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tool_model())


# ------------------------------------------------------------------ task module


@settings(max_examples=200, deadline=None)
@given(
    nums=st.lists(st.integers(0, 999), min_size=1, max_size=4),
    ops=st.lists(st.sampled_from(["+", "-", "*"]), min_size=3, max_size=3),
    parens=st.booleans(),
)
def test_evaluator_matches_python_arithmetic(nums, ops, parens):
    expr = str(nums[0])
    for op, n in zip(ops, nums[1:]):
        expr = f"({expr} {op} {n})" if parens else f"{expr} {op} {n}"
    assert evaluate_expression(expr) == eval(expr)  # reference only: trusted, generated input


@pytest.mark.parametrize(
    "bad, fragment",
    [("2 ** 3", "2 ** 3"), ("x + 1", "'x'"), ("7 / 2", "7 / 2"), ("1.5 + 2", "1.5"), ("", "empty"),
     ("1 +", "cannot parse"), ("9" * 300, "too long"), ("__import__('os')", "__import__"), ("True + 1", "True")],
)
def test_evaluator_refuses_with_named_part(bad, fragment):
    with pytest.raises(ExpressionError, match=None) as e:
        evaluate_expression(bad)
    assert fragment in str(e.value)


def test_evaluator_refuses_huge_values():
    with pytest.raises(ExpressionError, match="out of range"):
        evaluate_expression(" * ".join(["999999"] * 5))


def test_generator_is_seeded_and_within_recipe():
    a, b = generate_questions(300, 11), generate_questions(300, 11)
    assert [q.to_dict() for q in a] == [q.to_dict() for q in b]
    assert [q.question for q in a] != [q.question for q in generate_questions(300, 12)]
    multi = 0
    for q in a:
        calls = q.expected_calls()
        assert len(calls) == q.num_calls in (1, 2)
        multi += q.num_calls == 2
        operands = [int(t) for t in q.expression.split() if t.lstrip("-").isdigit()]
        assert all(1 <= n <= 999 for n in operands)
        n_ops = len(operands) - 1 + len(q.followups)
        assert 1 <= n_ops <= 3
        for f in q.followups:
            assert 1 <= f.operand <= 999 and str(f.operand) in q.question
        assert q.answer == evaluate_expression(calls[-1])
    assert 50 < multi < 130  # ~30% need two calls


def test_followup_uses_previous_result():
    q = ArithmeticQuestion("Compute 12 + 5 and then multiply the result by 7.", "12 + 5", (FollowUp("*", 7),))
    assert q.expected_calls() == ["12 + 5", "17 * 7"]
    assert q.answer == 119
    q2 = ArithmeticQuestion("Compute 3 - 8, then subtract the result from 10.", "3 - 8", (FollowUp("-", 10, False),))
    assert q2.expected_calls() == ["3 - 8", "10 - -5"] and q2.answer == 15


def test_final_answer_extraction():
    assert extract_final_answer("The answer is 396.") == 396
    assert extract_final_answer("First The answer is 1. then The answer is -42.") == -42
    assert extract_final_answer("The answer is 396") is None
    assert extract_final_answer("no answer") is None
    assert is_correct("The answer is 7.", 7) and not is_correct("The answer is 8.", 7)


def test_reference_messages_chain_tool_calls():
    q = ArithmeticQuestion("Compute 2 * 3 and then add 4 to the result.", "2 * 3", (FollowUp("+", 4),))
    msgs = reference_messages(q)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "2 * 3"}}
    assert msgs[2]["content"] == "6" and msgs[2]["tool_call_id"] == msgs[1]["tool_calls"][0]["id"]
    assert msgs[3]["tool_calls"][0]["function"]["arguments"] == {"expression": "6 + 4"}
    assert msgs[-1]["content"] == "The answer is 10."


# ------------------------------------------------------------------ shipped folder


def test_model_folder_is_package_data_and_a_stock_config():
    path = tiny_tool_model()
    assert path.is_dir() and (path / "MODEL_CARD.md").is_file()
    cfg = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["max_position_embeddings"] >= 2048
    assert cfg["torch_dtype"] in ("float32", "bfloat16") and cfg["rope_theta"] > 0
    assert (path / "model.safetensors").stat().st_size < 10 * 2**20  # "a few MB"
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_cfg and tok_cfg["eos_token"] == "<|im_end|>"
    tok = json.loads((path / "tokenizer.json").read_text())
    im_end = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|im_end|>")
    assert cfg["eos_token_id"] == im_end and gen["eos_token_id"] == im_end
    assert cfg["vocab_size"] >= len(tok["model"]["vocab"])


def test_transformers_keeps_the_shipped_tokenizer_pipeline(tok):
    """AutoTokenizer must tokenize exactly as tokenizer.json says (for qwen2 folders transformers 5
    swaps in Qwen2's own pre-tokenizer; this is why the model is a Llama), digits in threes."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_tool_model() / "tokenizer.json"))
    text = "<|im_start|>user\nWhat is 98765 * 1007 - 4?<|im_end|>\n<tool_call>\n{}\n</tool_call> é"
    assert tok.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
    assert tok.tokenize("98765 1007") == ["987", "65", "Ġ", "100", "7"]


def test_markup_tokens_are_single_and_survive_skip_special(tok):
    for t in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    ids = tok.encode('<tool_call>\n{"name": "calculator"}\n</tool_call><|im_end|>', add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == '<tool_call>\n{"name": "calculator"}\n</tool_call>'
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == ids[-1]


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60))
def test_tokenizer_roundtrips_any_text(tok, text):
    """Byte-level: any text encodes with no unknown token and decodes back (NFC-normalized, as
    Qwen2's normalizer does)."""
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == unicodedata.normalize("NFC", text)


def test_chat_template_tools_tool_calls_and_tool_role(tok, script):
    msgs = [
        {"role": "user", "content": "Compute 12 + 5 and then multiply the result by 7."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 + 5"}}}]},
        {"role": "tool", "tool_call_id": "a", "name": "calculator", "content": "17"},
        {"role": "assistant", "content": "", "tool_calls": [  # OpenAI clients send arguments as a JSON string
            {"id": "b", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "17 * 7"}'}}]},
        {"role": "tool", "tool_call_id": "b", "name": "calculator", "content": "119"},
    ]
    text = tok.apply_chat_template(msgs, tools=[CALCULATOR_TOOL], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(CALCULATOR_TOOL) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 5"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n17\n</tool_response><|im_end|>\n") in text
    assert '{"name": "calculator", "arguments": {"expression": "17 * 7"}}' in text
    assert text.endswith("<tool_response>\n119\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # Two tool results in a row share one user turn (Qwen2.5 style).
    two = tok.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}], tokenize=False
    )
    assert two.endswith("<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n")
    # A tool result that is not a string (a client's int or JSON value) renders as its text.
    num = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "tool", "content": 42}], tokenize=False)
    assert num.endswith("<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n")
    # A system message replaces the default; without tools it is a plain system turn.
    sys_text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}], tokenize=False)
    assert sys_text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    # The training script rendered exactly what transformers renders at inference time.
    q = generate_questions(3, 5)[2]
    ref = reference_messages(q)
    assert script.render(ref) == tok.apply_chat_template(ref, tools=[CALCULATOR_TOOL], tokenize=False)


def test_training_mask_covers_exactly_the_assistant_turns(tok, script):
    q = ArithmeticQuestion("Compute 2 * 3 and then add 4 to the result.", "2 * 3", (FollowUp("+", 4),))
    msgs = reference_messages(q)
    ids, mask = script.encode_for_training(tok, msgs)
    assert ids == tok.encode(script.render(msgs), add_special_tokens=False)
    learned = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert learned == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call><|im_end|>'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 + 4"}}\n</tool_call><|im_end|>'
        "The answer is 10.<|im_end|>"
    )


# ------------------------------------------------------------------ accuracy (issue 3 thresholds)


@pytest.mark.slow
def test_greedy_accuracy_on_fresh_questions(script):
    assert script.EVAL_SEED != script.TRAIN_SEED
    ev = script.evaluate(tiny_tool_model(), n=200, seed=script.EVAL_SEED)
    assert ev["n"] == 200 and ev["multi_call"]["n"] > 20
    assert ev["tool_call_accuracy"] >= 0.90, ev
    assert ev["final_answer_accuracy"] >= 0.80, ev


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_accuracy_holds_on_other_fresh_question_sets(script, seed):
    """The thresholds are not a property of one lucky question set."""
    ev = script.evaluate(tiny_tool_model(), n=200, seed=seed)
    assert ev["tool_call_accuracy"] >= 0.90 and ev["final_answer_accuracy"] >= 0.80, ev
    assert ev["multi_call"]["final_answer_accuracy"] >= 0.80, ev  # two-call questions too


def test_accuracy_is_not_a_property_of_the_harness(script, tmp_path):
    """The same evaluation on an untrained model of the same shape scores zero: the metric can fail."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    hf_tok = AutoTokenizer.from_pretrained(tiny_tool_model())
    AutoModelForCausalLM.from_config(script.make_config(hf_tok)).save_pretrained(tmp_path)
    hf_tok.save_pretrained(tmp_path)
    ev = script.evaluate(tmp_path, n=20, seed=random.Random(3).randint(1, 10**6) + 10**7)
    assert ev["tool_call_accuracy"] == 0.0 and ev["final_answer_accuracy"] == 0.0
