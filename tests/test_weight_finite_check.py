"""Non-finite weights (NaN/Inf) are refused before they reach an engine, naming the tensor (issue 14).

`check_finite` is one sum per floating tensor with an element scan only when that sum is not finite,
so it must neither miss a NaN/Inf (any dtype, any position) nor refuse a finite tensor whose sum
overflows (float16). The SGLang client runs it before serializing anything; the CPU engine runs it
before writing anything (tests/test_local_engine_errors.py)."""

from __future__ import annotations

import pytest
import torch

from agentloop.engine.base import EngineError
from agentloop.engine.sglang import SGLangClient
from agentloop.engine.weight_payloads import NonFiniteWeightsError, check_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_any_non_finite_value_is_refused_with_the_tensors_name(dtype: torch.dtype, bad: float) -> None:
    good = torch.randn(8, 16).to(dtype)
    t = torch.randn(33, 7).to(dtype)
    t[32, 6] = bad  # the very last element: no early exit can skip it
    with pytest.raises(NonFiniteWeightsError, match=r"tensor 'layers.1.w' holds \d NaN and \d Inf value\(s\) of 231"):
        check_finite([("layers.0.w", good), ("layers.1.w", t), ("layers.2.w", good)])


def test_finite_updates_pass_even_when_their_sum_overflows() -> None:
    big16 = torch.full((4096,), 60000.0, dtype=torch.float16)  # sums far past float16's max, all finite
    big32 = torch.full((16,), 3e38, dtype=torch.float32)  # float32 sum overflows to inf, values finite
    ints = torch.arange(10)  # not floating: nothing to check
    check_finite([("a", big16), ("b", big32), ("c", ints), ("d", torch.empty(0)), ("e", torch.randn(3, 3))])
    with pytest.raises(NonFiniteWeightsError, match="'b' holds 0 NaN and 1 Inf"):
        check_finite([("b", torch.cat([big32, torch.tensor([float("inf")])]))])


async def test_client_refuses_before_sending_and_the_setting_turns_it_off() -> None:
    # Nothing listens on port 9: a request that went out would fail as unreachable, not as refused.
    named = [("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.tensor([1.0, float("nan")]))]
    async with SGLangClient("http://127.0.0.1:9", tensor_transport="safetensors", retries=0) as client:
        with pytest.raises(EngineError, match="refused before sending: tensor 'lm_head.weight' holds 1 NaN") as e:
            await client.update_weights_from_tensor(named)
        assert e.value.status is None and e.value.endpoint == "/update_weights_from_tensor"
    async with SGLangClient("http://127.0.0.1:9", tensor_transport="safetensors", retries=0,
                            check_finite_weights=False) as client:
        with pytest.raises(EngineError, match="cannot connect"):
            await client.update_weights_from_tensor(named)


def test_benchmark_runs_and_reports_ms_per_gb(tmp_path) -> None:
    """`benchmarks/weight_finite_check.py --smoke` (the GPU script runs it with `--device cuda`)."""
    import json
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import weight_finite_check
    finally:
        sys.path.remove(str(bench))
    assert weight_finite_check.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "weight_finite_check_cpu_smoke.json").read_text())
    assert report["benchmark"] == "weight_finite_check" and report["hardware"]["device"] == "cpu"
    assert [r["dtype"] for r in report["results"]] == ["float32", "bfloat16"]
    assert all(r["check_finite_ms_per_gb"] > 0 and r["isfinite_all_ms_per_gb"] > 0 for r in report["results"])
