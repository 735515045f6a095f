"""Unit tests of the CPU engine's parts (no server): sampler and its logprob convention, sampling
params validation, the padded batch KV cache, memory release/resume, the random model builder, and
LocalEngineProcess's start failure report."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentloop.engine.local.kv_cache import BatchKV
from agentloop.engine.local.memory import MemoryManager, MemoryTagError
from agentloop.engine.local.model_runner import ModelRunner
from agentloop.engine.local.sampling import RequestSampling, SamplingParamsError, sample_next
from agentloop.models.random_model import make_random_model

torch.set_num_threads(1)


def params(**kw) -> RequestSampling:
    return RequestSampling.from_json(kw, vocab_size=100)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- sampling ------------------------------------------------------------------------------------
def test_greedy_and_logprob_conventions() -> None:
    logits = torch.randn(3, 100, generator=gen(1)) * 3
    p_greedy, p_hot = params(temperature=0.0), params(temperature=0.5, sampling_seed=3)
    out = sample_next(logits[:2], [p_greedy, p_hot], [gen(), gen()], top_logprobs_nums=[2, 0])
    assert out[0].token_id == int(logits[0].argmax())
    assert out[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[out[0].token_id]))
    assert out[0].top[0] == (pytest.approx(out[0].logprob), out[0].token_id)
    # SGLang default: the temperature-scaled distribution, before any truncation.
    scaled = torch.log_softmax(logits[1] / 0.5, -1)
    assert out[1].logprob == pytest.approx(float(scaled[out[1].token_id]))
    orig = sample_next(logits[1:2], [p_hot], [gen()], top_logprobs_nums=[0], original_logprob=True)[0]
    assert orig.logprob == pytest.approx(float(torch.log_softmax(logits[1], -1)[orig.token_id]))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    top_k=st.one_of(st.just(-1), st.integers(1, 20)),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
    temperature=st.floats(0.1, 2.0),
)
def test_sampled_token_respects_truncation(seed: int, top_k: int, top_p: float, min_p: float, temperature: float) -> None:
    logits = torch.randn(1, 100, generator=gen(seed)) * 2
    p = params(top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
    tok = sample_next(logits, [p], [gen(seed)], top_logprobs_nums=[0])[0].token_id
    probs = torch.softmax(logits[0] / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    rank = order.index(tok)
    if top_k > 0:
        assert rank < top_k
    mass_before = float(probs[order[:rank]].sum())
    assert mass_before <= top_p + 1e-6
    assert float(probs[tok]) >= float(probs[order[0]]) * min_p - 1e-7


def test_seeded_rows_are_independent_of_batch_neighbours() -> None:
    logits = torch.randn(4, 100, generator=gen(5))
    p = params(temperature=1.0)
    alone = [sample_next(logits[i:i + 1], [p], [gen(10 + i)], top_logprobs_nums=[0])[0].token_id for i in range(4)]
    together = sample_next(logits, [p] * 4, [gen(10 + i) for i in range(4)], top_logprobs_nums=[0] * 4)
    assert [s.token_id for s in together] == alone


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.zeros(1, 100)
    logits[0, 7] = 50.0
    out = sample_next(logits, [params(temperature=0.0)], [gen()], top_logprobs_nums=[0], banned=[[7]])[0]
    assert out.token_id != 7


def test_sampling_params_validation() -> None:
    ok = params(max_new_tokens=5, n=1, repetition_penalty=1.0, skip_special_tokens=False, stop=[], stop_token_ids=[3])
    assert ok.max_new_tokens == 5 and ok.stop_token_ids == [3] and not ok.greedy
    assert params(temperature=1e-7).greedy
    for bad, field in [({"top_k": -2}, "top_k"), ({"ignore_eos": "yes"}, "ignore_eos"),
                       ({"sampling_seed": 1.5}, "sampling_seed"), ({"min_new_tokens": 9, "max_new_tokens": 3}, "min_new_tokens"),
                       ({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {"100": 1}}, "logit_bias"), ({"foo": 1}, "foo")]:
        with pytest.raises(SamplingParamsError, match=field):
            params(**bad)


# ---- KV cache, runner, memory ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner(random_model_dir: Path) -> ModelRunner:
    return ModelRunner(random_model_dir)


def test_batch_kv_rows_match_unbatched_forward(runner: ModelRunner) -> None:
    seqs = [[5, 6, 7, 8, 9, 10], [20, 21], [30, 31, 32, 33]]
    kv, last = BatchKV(), []
    logits, cache, mask = runner.prefill_batch(seqs[:2])  # padded prefill of two rows
    for i, s in enumerate(seqs[:2]):
        alone = runner.prefill(s)[0]
        torch.testing.assert_close(logits[i, -1], alone, atol=1e-4, rtol=0)
        last.append(int(alone.argmax()))
    kv.merge(BatchKV.from_cache(cache, mask))
    logits, cache = runner.prefill(seqs[2])  # a later join
    kv.merge(BatchKV.from_cache(cache, torch.ones(1, len(seqs[2]), dtype=torch.long)))
    last.append(int(logits.argmax()))
    assert kv.padded_len == 6 and kv.real_lengths().tolist() == [6, 2, 4]
    logits = runner.decode(kv, last)
    for i, s in enumerate(seqs):
        with torch.no_grad():
            ref = runner.model(torch.tensor([s + [last[i]]])).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=0)
    kv.keep([1, 2])  # the longest row leaves: padding nobody needs is trimmed
    assert kv.batch_size == 2 and kv.padded_len == 5 and kv.real_lengths().tolist() == [3, 5]
    kv.keep([])
    assert kv.batch_size == 0 and kv.nbytes() == 0


def test_memory_release_frees_storage_and_resume_gives_zeros(random_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(random_model_dir), dtype=torch.float32)
    mem = MemoryManager(model)
    full = mem.weights_bytes()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    mem.release(["weights"])
    assert mem.weights_bytes() == 0 and all(p.numel() == 0 for p in model.parameters())
    assert "weights" in mem.generation_block_reason()
    with pytest.raises(MemoryTagError, match="already released.*real SGLang 0.5.17 would crash here"):
        mem.release(["kv_cache", "weights"])  # a double release kills SGLang: refused, nothing changed
    assert mem.released == {"weights"}
    with pytest.raises(MemoryTagError, match="not released.*would crash here"):
        mem.resume(["kv_cache"])
    mem.resume(["weights"])
    assert mem.weights_bytes() == full and not mem.weights_valid
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    assert all(float(p.detach().abs().sum()) == 0.0 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert mem.generation_block_reason() is None
    with pytest.raises(MemoryTagError, match="unknown memory tag"):
        mem.release(["weights", "vram"])
    mem.release(None)
    assert mem.released == {"weights", "kv_cache", "cuda_graph"}


# ---- random model builder ------------------------------------------------------------------------
def _digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_random_model_is_deterministic_and_configurable(tmp_path: Path, random_model_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    again = make_random_model(tmp_path / "again", seed=0)
    assert _digest(again) == _digest(random_model_dir)
    assert _digest(make_random_model(tmp_path / "seed1", seed=1)) != _digest(random_model_dir)
    llama = make_random_model(tmp_path / "llama", arch="llama", vocab_size=512, hidden_size=32, num_layers=1,
                              tokenizer_from=random_model_dir)
    cfg = AutoConfig.from_pretrained(str(llama))
    assert cfg.model_type == "llama" and cfg.vocab_size == 512 and cfg.hidden_size == 32 and cfg.num_hidden_layers == 1
    tok = AutoTokenizer.from_pretrained(str(random_model_dir))
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_random_model(tmp_path / "small", vocab_size=10)


# ---- process -------------------------------------------------------------------------------------
async def test_engine_process_start_failure_reports_log_tail(tmp_path: Path) -> None:
    from agentloop.engine.local.process import EngineStartError, LocalEngineProcess

    (tmp_path / "config.json").write_text("{not json")
    proc = LocalEngineProcess(tmp_path, extra_args=["--num-threads", "1"], log_path=tmp_path / "serve.log")
    with pytest.raises(EngineStartError) as err:
        await proc.start(timeout=60)
    assert "exited with code" in str(err.value) and "Traceback" in str(err.value)
    assert proc.url.startswith("http://127.0.0.1:")


# ---- model-update lock (SGLang's RWLock semantics) -------------------------------------------------
async def test_model_update_lock_writer_waits_and_has_preference() -> None:
    import asyncio

    from agentloop.engine.local.update_lock import ModelUpdateLock

    lock, order = ModelUpdateLock(), []
    first_in, release_first = asyncio.Event(), asyncio.Event()

    async def reader(name: str, hold: asyncio.Event | None = None) -> None:
        async with lock.reader():
            order.append(f"{name} in")
            if hold is not None:
                first_in.set()
                await hold.wait()
        order.append(f"{name} out")

    async def writer() -> None:
        async with lock.writer():
            order.append("writer")

    r1 = asyncio.create_task(reader("r1", release_first))
    await first_in.wait()
    w = asyncio.create_task(writer())
    await asyncio.sleep(0.01)
    r2 = asyncio.create_task(reader("r2"))  # arrives while the writer waits: queued behind it
    await asyncio.sleep(0.01)
    assert order == ["r1 in"]
    release_first.set()
    await asyncio.gather(r1, w, r2)
    assert order == ["r1 in", "r1 out", "writer", "r2 in", "r2 out"]

    # a writer cancelled while waiting lets the readers queued behind it go
    hold = asyncio.Event()
    first_in.clear()
    r3 = asyncio.create_task(reader("r3", hold))
    await first_in.wait()
    w2 = asyncio.create_task(writer())
    await asyncio.sleep(0.01)
    r4 = asyncio.create_task(reader("r4"))
    await asyncio.sleep(0.01)
    w2.cancel()
    await asyncio.wait_for(r4, 1)
    hold.set()
    await r3
    assert lock.readers == 0
