"""`scheduler.concurrency: auto` (agentloop.runtime.concurrency) and the engine busy fraction of a step
(agentloop.output.engine_use): the capacity read from SGLang-shaped `/server_info` answers, the CPU
engine's default, the fallbacks, and a throttled step made visible."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from agentloop.config.rollout import load_config
from agentloop.config.settings import RuntimeConfig
from agentloop.output.engine_use import engine_use, total_engine_use
from agentloop.output.summary import summarize_run, summarize_step
from agentloop.runtime.concurrency import CPU_ENGINE_CONCURRENCY, resolve_concurrency, server_capacity
from agentloop.types import TimelineEvent, Trajectory

# What SGLang 0.5.x answers (trimmed): server args (max_running_requests null unless given), the
# scheduler's init info (max_total_num_tokens), one internal state per DP rank.
SGLANG_INFO: dict[str, Any] = {
    "model_path": "/m", "max_running_requests": None, "dp_size": 1, "max_total_num_tokens": 2_000_000,
    "internal_states": [{"last_gen_throughput": 0.0, "effective_max_running_requests_per_dp": 1024}],
    "version": "0.5.17",
}


class FakeClient:
    def __init__(self, url: str, info: dict[str, Any] | None) -> None:
        self.url, self.info = url, info

    async def server_info(self) -> dict[str, Any]:
        if self.info is None:
            raise OSError("connection refused")
        return self.info


def resolve(setting: Any, *infos: dict[str, Any] | None) -> Any:
    cfg = RuntimeConfig.model_validate({"scheduler": {"concurrency": setting}})
    clients = [FakeClient(f"http://h{i}:1", info) for i, info in enumerate(infos)]
    return anyio.run(resolve_concurrency, cfg, clients)


def test_server_capacity_reads_sglang_fields() -> None:
    assert server_capacity(SGLANG_INFO) == 1024
    two_ranks = {**SGLANG_INFO, "dp_size": 2, "internal_states": [
        {"effective_max_running_requests_per_dp": 512}, {"effective_max_running_requests_per_dp": 512}]}
    assert server_capacity(two_ranks) == 1024
    # An older server without the internal state: the launch argument, times the DP ranks.
    assert server_capacity({"max_running_requests": 96, "dp_size": 2, "internal_states": [{}]}) == 192
    assert server_capacity({"max_running_requests": None}) is None
    assert server_capacity({"internal_states": "x", "max_running_requests": True}) is None


def test_auto_on_sglang_is_the_sum_of_the_servers_capacity() -> None:
    cfg, info = resolve("auto", SGLANG_INFO, {**SGLANG_INFO, "internal_states": [
        {"effective_max_running_requests_per_dp": 256}]})
    assert cfg.scheduler.concurrency == 1280 and info.used == 1280 and info.engine_capacity == 1280
    assert info.setting == "auto" and "max running requests" in info.rule
    assert info.per_server["http://h0:1"] == {"engine": "sglang", "max_running_requests": 1024,
                                             "max_total_num_tokens": 2_000_000}


def test_auto_on_the_cpu_engine_keeps_its_default() -> None:
    cpu = {"engine": "agentloop-cpu", "max_running_requests": 64,
           "internal_states": [{"effective_max_running_requests_per_dp": 64}]}
    cfg, info = resolve("auto", cpu, cpu)
    assert cfg.scheduler.concurrency == CPU_ENGINE_CONCURRENCY == info.used
    assert info.engine_capacity == 128 and "CPU engine" in info.rule


def test_a_given_number_is_kept_and_an_unanswering_server_is_said() -> None:
    cfg, info = resolve(32, SGLANG_INFO)
    assert cfg.scheduler.concurrency == 32 and info.rule == "set in the configuration" and info.engine_capacity == 1024
    cfg, info = resolve("auto", SGLANG_INFO, None)
    assert cfg.scheduler.concurrency == 1024 + CPU_ENGINE_CONCURRENCY
    assert info.engine_capacity is None and "http://h1:1 reported none" in info.rule


def test_concurrency_setting_accepts_auto_or_a_positive_integer() -> None:
    assert RuntimeConfig().scheduler.concurrency == "auto"
    assert load_config(None, {"runtime.scheduler.concurrency": ("auto", "--concurrency")}).runtime.scheduler.concurrency == "auto"
    with pytest.raises(Exception, match="--concurrency"):
        load_config(None, {"runtime.scheduler.concurrency": (0, "--concurrency")})
    with pytest.raises(Exception, match="concurrency"):
        RuntimeConfig.model_validate({"scheduler": {"concurrency": "lots"}})


def traj(uid: str, events: list[tuple[str, float, float]]) -> Trajectory:
    return Trajectory(uid=uid, group_id=uid, prompt_ids=[1], response_ids=[], response_mask=[],
                      response_logprobs=[], timeline=[TimelineEvent(k, a, b) for k, a, b in events])


def test_engine_busy_fraction_of_a_throttled_step() -> None:
    # Concurrency 2 on an engine that runs 8: two trajectories at a time, each generate 1 s, tool 1 s.
    trajs = [traj("a", [("queue", 0, 0), ("generate", 0, 1), ("tool", 1, 2), ("generate", 2, 3)]),
             traj("b", [("queue", 0, 0), ("generate", 0, 1), ("tool", 1, 2), ("generate", 2, 3)]),
             traj("c", [("queue", 0, 3), ("generate", 3, 4)]),
             # a request that waited 0.5 s for a per-server slot inside its generate span
             traj("d", [("queue", 0, 3), ("generate", 3, 4), ("wait", 3, 3.5)])]
    use = engine_use(trajs, concurrency=2, engine_capacity=8)
    assert use is not None and use["span_seconds"] == 4
    # generate area: a 2 + b 2 + c 1 + d 0.5 = 5.5 request-seconds over 4 s
    assert use["generate_in_flight_mean"] == pytest.approx(5.5 / 4, abs=1e-3)
    assert use["engine_busy_fraction"] == pytest.approx(5.5 / 4 / 8, abs=1e-4)
    assert use["generate_busy_fraction"] == pytest.approx(3 / 4)  # [1, 2) every trajectory runs its tool
    assert use["trajectories_in_flight_mean"] == pytest.approx(2.0) and use["slot_busy_fraction"] == pytest.approx(1.0)
    assert engine_use([], concurrency=2, engine_capacity=8) is None
    assert engine_use(trajs, concurrency=2, engine_capacity=None)["engine_busy_fraction"] is None
    # summary.json: per step as computed, the run's total weighted by each step's span.
    s1 = summarize_step(trajs, step=1, engine_use=use)
    s2 = summarize_step(trajs[:2], step=2, engine_use=engine_use(trajs[:2], concurrency=2, engine_capacity=8))
    run = summarize_run([s1, s2])
    assert s1["engine_use"] == use
    total = run["engine_use"]
    assert total["span_seconds"] == 7 and total["concurrency"] == 2 and total["engine_capacity"] == 8
    assert total["generate_busy_fraction"] == pytest.approx((0.75 * 4 + 2 / 3 * 3) / 7, abs=1e-4)
    assert total_engine_use([None]) is None


def test_the_progress_line_shows_concurrency_and_engine_busy() -> None:
    import io

    from agentloop.output.progress import RolloutProgress

    buf = io.StringIO()
    p = RolloutProgress(quiet=True, stream=buf)
    p.begin_step(1, 2, 64)
    p.end_step({"status": {"completed": 64}, "tool_calls": 70, "tokens_per_second": 3700.0,
                "seconds": {"wake_up": 0.02, "sleep": 0.03},
                "engine_use": {"concurrency": 32, "engine_capacity": 1024, "engine_busy_fraction": 0.0294,
                               "generate_in_flight_mean": 30.1}})
    assert "3700 tok/s; concurrency 32, engine busy 3% (30.1 of 1024 requests in flight on average);" in buf.getvalue()
