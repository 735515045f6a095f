"""`scheduler.concurrency: auto` (agentloop.runtime.concurrency) and the engine busy fraction of a step
(agentloop.output.engine_use): the capacity read from SGLang-shaped `/server_info` answers, the CPU
engine's default, the fallbacks, and a throttled step made visible; `scheduler.per_server_concurrency:
auto` (the servers' decode CUDA graph batch) read the same way and held by a runtime over two steps."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from agentloop.config.rollout import load_config
from agentloop.engine.sglang import SGLangClient
from agentloop.config.settings import RuntimeConfig
from agentloop.output.engine_use import engine_use, total_engine_use
from agentloop.output.summary import summarize_run, summarize_step
from agentloop.runtime import Runtime
from agentloop.runtime.assembly import make_router
from agentloop.runtime.concurrency import CPU_ENGINE_CONCURRENCY, decode_graph_batch, resolve_concurrency, server_capacity
from agentloop.types import Sample, TimelineEvent, Trajectory

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


def resolve(setting: Any, *infos: dict[str, Any] | None, per_server: Any = None) -> Any:
    cfg = RuntimeConfig.model_validate({"scheduler": {"concurrency": setting, "per_server_concurrency": per_server}})
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


def test_decode_graph_batch_reads_the_server_args() -> None:
    # sglang 0.5.17: the resolved config (a dataclass in the server args, a dict in /server_info) ...
    assert decode_graph_batch({"cuda_graph_config": {"decode": {"backend": "full", "max_bs": 256}},
                               "cuda_graph_max_bs_decode": None}) == 256
    assert decode_graph_batch({"cuda_graph_config": {"decode": {"backend": "disabled", "max_bs": 256}}}) is None
    # ... else the launch flag, else the older single flag; disabled graphs or odd values mean none.
    assert decode_graph_batch({"cuda_graph_config": "x", "cuda_graph_max_bs_decode": 128}) == 128
    assert decode_graph_batch({"cuda_graph_max_bs": 160}) == 160
    assert decode_graph_batch({"cuda_graph_max_bs": 160, "disable_cuda_graph": True}) is None
    for odd in (0, -4, True, "256", 2.5, None):
        assert decode_graph_batch({"cuda_graph_config": {"decode": {"max_bs": odd}}, "cuda_graph_max_bs": odd}) is None


def test_per_server_auto_is_the_smallest_decode_graph_batch_or_no_limit() -> None:
    big = {**SGLANG_INFO, "cuda_graph_config": {"decode": {"backend": "full", "max_bs": 256}}}
    small = {**SGLANG_INFO, "cuda_graph_max_bs_decode": 160}
    cfg, info = resolve("auto", big, small, per_server="auto")
    assert cfg.scheduler.per_server_concurrency == 160 == info.per_server_used and info.per_server_setting == "auto"
    assert make_router(None, cfg).per_server_limit == 160  # type: ignore[arg-type]
    cfg, info = resolve("auto", big, SGLANG_INFO, per_server="auto")  # one silent server: the other's batch
    assert cfg.scheduler.per_server_concurrency == 256 and "http://h1:1 reported none" in info.per_server_rule
    cfg, info = resolve("auto", SGLANG_INFO, None, per_server="auto")  # none reports one (or answers): no limit
    assert cfg.scheduler.per_server_concurrency is None and "no per-server limit" in info.per_server_rule
    cfg, info = resolve("auto", big, per_server=12)  # a number is kept; not set means no limit
    assert cfg.scheduler.per_server_concurrency == 12 and info.per_server_rule == "set in the configuration"
    assert resolve("auto", big)[1].per_server_used is None
    unresolved = RuntimeConfig.model_validate({"scheduler": {"per_server_concurrency": "auto"}})
    with pytest.raises(ValueError, match="resolved when a Runtime starts"):
        make_router(None, unresolved)  # type: ignore[arg-type]
    for bad in (0, "many", True):
        with pytest.raises(Exception, match="per_server_concurrency"):
            RuntimeConfig.model_validate({"scheduler": {"per_server_concurrency": bad}})


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


class GraphReportingClient(SGLangClient):
    """The real client of the CPU engine, whose `/server_info` also reports SGLang 0.5.17's decode CUDA
    graph batch (the CPU engine has no graphs), counting the generates in flight at once."""

    def __init__(self, url: str, graph_bs: int) -> None:
        super().__init__(url)
        self.graph_bs, self.in_flight, self.peak = graph_bs, 0, 0

    async def server_info(self) -> dict[str, Any]:
        info = dict(await super().server_info())
        info["cuda_graph_config"] = {"decode": {"backend": "full", "max_bs": self.graph_bs}}
        return info

    async def generate(self, *a: Any, **kw: Any) -> Any:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            return await super().generate(*a, **kw)
        finally:
            self.in_flight -= 1


def test_per_server_auto_limits_the_requests_a_runtime_sends_over_two_steps(local_engine: str, random_model_dir: Any) -> None:
    turns = [{"gen_tokens": 6, "tool_latency_s": 0.0, "tool_result_tokens": 2} for _ in range(2)]
    client = GraphReportingClient(local_engine, 3)

    async def main() -> list[Any]:
        rt = Runtime({"engine": {"tokenizer": str(random_model_dir)}, "scheduler": {"per_server_concurrency": "auto"}},
                     clients=[client])
        results = []
        async with rt:
            assert rt.concurrency is not None and rt.concurrency.per_server_used == 3
            assert rt.config.scheduler.per_server_concurrency == 3
            for step in range(2):  # the lifecycle's bugs show on step 2
                samples = [Sample(uid=f"s{step}-{i}", messages=[], agent="replay",
                                  extra={"replay": {"prompt_tokens": 8, "turns": turns}}) for i in range(12)]
                results.append(await rt.step(samples))
        return results

    results = anyio.run(main)
    assert all(t.status == "completed" for r in results for t in r.trajectories)
    assert sum(len(r.trajectories) for r in results) == 24
    assert 1 < client.peak <= 3  # requests overlapped, never more than the graphs' batch
