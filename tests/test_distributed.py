"""Ray mode (`agentloop.distributed`) on a local CPU Ray cluster: 2 workers x 2 CPU engines.

One Ray session and one `RayRuntime` serve the whole module (engines and workers take seconds to
start on the 2-core CI machine); the tests run in file order and the destructive ones come last.
What is shown:
- GPU servers are reserved together on a placement group; two with num_gpus=0.5 share the one GPU
  (a logical GPU of the CPU cluster), and a fleet that does not fit fails with the reason;
- Ray mode and local mode give the same trajectories token for token (greedy) over 2 steps, each
  with the staged wake-up and the sleep fanned out to both engines, and no worker dispatch outside
  the driver's AWAKE window (the engines also refuse generation while asleep);
- work is handed out as workers free up (a worker stuck with long trajectories gets fewer), and the
  members of one GRPO group run on different workers;
- over-sampling stops the unfinished trajectories on whichever worker runs them and carries them
  over; they finish next step;
- a sleep in the middle of a step drains every worker before memory is released, and the aborted
  trajectories continue next step;
- `ray.kill` of a worker mid-step loses nothing: its trajectories re-run elsewhere, the step result
  lists them, and the tokens equal an undisturbed run;
- a SIGKILLed engine server mid-step is taken out, the step completes, and the next one runs on the
  remaining server.
The `replay` agent loop drives a tiny random model (turn structure from the sample, tokens sampled).
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from agentloop.config import LocalServerConfig, RuntimeConfig  # noqa: E402
from agentloop.data import arithmetic_prompts  # noqa: E402
from agentloop.distributed import EngineFleet, EngineSpec, RayRuntime, WorkerStartError  # noqa: E402
from agentloop.engine.gate import Gate  # noqa: E402
from agentloop.engine.base import EngineError, GenerateOutput, SamplingParams  # noqa: E402
from agentloop.engine.lifecycle import EngineState  # noqa: E402
from agentloop.engine.sglang import SGLangClient  # noqa: E402
from agentloop.models.random_model import make_random_model  # noqa: E402
from agentloop.runtime import Runtime, StepResult  # noqa: E402
from agentloop.tools.builtin import CalculatorTool  # noqa: E402
from agentloop.tools.registry import ToolRegistry  # noqa: E402
from agentloop.types import Sample, Trajectory  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a local Ray cluster: a minute to start

ENGINE_LOCAL = {"num_threads": 1, "log_level": "warning"}
WAKE = ["resume_weights", "update_weights", "resume_kv_cache"]
SLEEP = ["pause", "settle", "continue", "flush_cache", "release"]


def replay_samples(prefix: str, n: int, *, turns: int = 2, gen: int = 6, latency: float = 0.02,
                   reward: str | None = None) -> list[Sample]:
    spec = {"prompt_tokens": 12, "turns": [{"gen_tokens": gen, "tool_latency_s": latency, "tool_result_tokens": 3}] * turns}
    return [Sample(uid=f"{prefix}{i}", messages=[{"role": "user", "content": "x"}], agent="replay",
                   extra={"replay": spec}, reward=reward, ground_truth=42) for i in range(n)]


def config(model: Path, servers: int) -> dict[str, Any]:
    return {
        "engine": {"model": str(model), "num_local_servers": servers, "local": ENGINE_LOCAL},
        "scheduler": {"n": 2},
        # Turns up to 1000 tokens: the sleep-mid-step test needs a first turn no machine finishes before the sleep.
        "agent": {"sampling": {"temperature": 0.0, "seed": 7}, "max_new_tokens_per_turn": 1000, "max_response_tokens": 1100},
    }


def tokens(t: Trajectory) -> tuple[Any, ...]:
    return (t.uid, t.group_id, t.status, t.num_turns, t.prompt_ids, t.response_ids, t.response_mask, t.reward)


def assert_same(a: list[Trajectory], b: list[Trajectory]) -> None:
    by_uid = {t.uid: t for t in b}
    assert sorted(by_uid) == sorted(t.uid for t in a)
    for t in a:
        u = by_uid[t.uid]
        assert tokens(t) == tokens(u), t.uid
        assert t.response_logprobs == pytest.approx(u.response_logprobs, abs=1e-4), t.uid


def on_portal(rt: Runtime, fn: Callable[[], Any]) -> Any:
    """Run an async method of a runtime used through its sync facade, on its event loop."""
    return rt._blocking_portal().call(fn)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(tmp_path_factory.mktemp("dist") / "model", seed=1)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    # One logical GPU (no real one): lets the placement-group path of GPU servers run here.
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def rt(ray_session: None, model_dir: Path) -> Iterator[RayRuntime]:
    runtime = RayRuntime(config(model_dir, 2), ray_config={"num_workers": 2, "worker_capacity": 2, "engine_num_cpus": 1})
    runtime.start_sync()
    yield runtime
    runtime.stop_sync()


@pytest.fixture(scope="module")
def local_reference(model_dir: Path) -> dict[str, list[Trajectory]]:
    """The same samples through local mode (no Ray), once per module."""
    out = {}
    with Runtime(config(model_dir, 1)) as local:
        for prefix, weights in step_weights(model_dir):
            out[prefix] = local.step_sync(replay_samples(prefix, 3, reward="arithmetic"), weights).trajectories
    return out


def step_weights(model_dir: Path) -> list[tuple[str, Any]]:
    """Step a reloads the weights from disk, step b loads them as tensors (a trainer's state dict)."""
    return [("a", None), ("b", load_file(str(model_dir / "model.safetensors")))]


# ---------------------------------------------------------------------- the gate, in-process
class _Engine:
    url = "http://engine"

    def __init__(self) -> None:
        self.generates = 0

    async def generate(self, input_ids, sampling_params, *, rid=None, return_logprob=True, timeout=None):
        self.generates += 1
        return GenerateOutput([1], [-0.1], {"type": "length", "length": 1}, "v", rid or "")


async def test_worker_gate_follows_the_driver_and_never_drives_engines() -> None:
    import anyio

    engine = _Engine()
    gate = Gate([engine])  # type: ignore[list-item]
    assert gate.state is EngineState.SLEEPING
    with pytest.raises(TimeoutError):  # closed: the generate waits at the gate
        await gate.generate(engine.url, [1, 2], SamplingParams(max_new_tokens=1), gate_timeout=0.2)
    assert engine.generates == 0
    await gate.open("v1")
    assert (await gate.generate(engine.url, [1, 2], SamplingParams(max_new_tokens=1))).output_ids == [1]
    assert await gate.close() == 0 and gate.state is EngineState.DRAINING
    with anyio.move_on_after(0.2):
        await gate.generate(engine.url, [1], SamplingParams(max_new_tokens=1))
    assert engine.generates == 1  # the generate sent while DRAINING never left the gate
    # a gate has no way to drive an engine: no wake-up, no sleep, no memory call
    assert not any(hasattr(gate, name) for name in ("wake_up", "sleep", "release", "resume"))


# ---------------------------------------------------------------------- engine placement
def test_two_servers_share_one_gpu_on_a_placement_group(ray_session: None, model_dir: Path) -> None:
    import anyio
    from ray.util.placement_group import placement_group_table

    async def go() -> None:
        fleet = EngineFleet([EngineSpec("local", str(model_dir), extra_args=LocalServerConfig(**ENGINE_LOCAL).serve_args())] * 2, num_cpus=0, num_gpus=0.5)
        try:
            urls = await fleet.start(timeout=120)
            info = await fleet.info()
            assert [i["url"] for i in info] == urls and len(set(urls)) == 2
            # Ray put both servers on the cluster's one GPU and told each process so.
            assert [i["gpu_ids"] for i in info] == [["0"], ["0"]]
            assert {i["cuda_visible_devices"] for i in info} == {"0"}
            assert placement_group_table(fleet.pg)["state"] == "CREATED"
            # ...and started them one after another (SGLang sizes its KV pool from the memory free at its start)
            (a0, a1), (b0, b1) = sorted(tuple(i["start_window"]) for i in info)
            assert a1 <= b0
            for url in urls:
                client = SGLangClient(url)
                assert "model_path" in await client.model_info()
                await client.close()
        finally:
            pg = fleet.pg
            await fleet.stop()
        assert placement_group_table(pg)["state"] == "REMOVED"
        for url in urls:  # the server processes are gone with the fleet
            client = SGLangClient(url, retries=0)
            with pytest.raises(EngineError):
                await client.model_info()
            await client.close()

    anyio.run(go)


def test_fleet_that_does_not_fit_says_why(ray_session: None, model_dir: Path) -> None:
    import anyio

    async def go() -> None:
        fleet = EngineFleet([EngineSpec("sglang", str(model_dir))] * 2, num_cpus=0, num_gpus=1, placement_timeout=2)
        try:
            with pytest.raises(RuntimeError, match=r"2 x \{'GPU': 1, 'CPU': 0\}.*lacks the GPUs"):
                await fleet.start()
            assert fleet.actors == []  # nothing was started
        finally:
            await fleet.stop()

    anyio.run(go)


def test_cpu_fleet_whose_actors_cannot_be_placed_says_why(ray_session: None, model_dir: Path) -> None:
    # No placement group for CPU servers: an actor asking more CPUs than any node has free would wait
    # for ever (its start, and the timeout inside it, never begin). The fleet bounds the wait.
    import anyio

    async def go() -> None:
        fleet = EngineFleet([EngineSpec("local", str(model_dir))], num_cpus=3, placement_timeout=2)
        try:
            with anyio.fail_after(60):
                with pytest.raises(RuntimeError, match=r"actor\(s\) \[0\] of 1 \(each \{'CPU': 3, 'GPU': 0.0\}\) "
                                                       r"not scheduled within 2s.*available_resources"):
                    await fleet.start()
        finally:
            with anyio.fail_after(10):  # the unplaced actor is killed, not asked to stop (that would wait)
                await fleet.stop()
        assert fleet.actors == []

    anyio.run(go)


# ---------------------------------------------------------------------- RayRuntime's arguments
class MarkedCalculator(CalculatorTool):
    """The calculator with its results marked: shows whose registry a worker's tool loop called."""

    async def execute(self, arguments: dict[str, Any], context: Any) -> str:
        return "marked " + await super().execute(arguments, context)


class LockedTool(CalculatorTool):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()  # cannot be pickled: such a registry cannot go to other processes


def test_ray_runtime_takes_every_runtime_argument(tmp_path: Path) -> None:
    local = dict(inspect.signature(Runtime.__init__).parameters)
    local.pop("rollout")  # where the agent loops run: what makes a RayRuntime (its RayRollout)
    ray_mode = inspect.signature(RayRuntime.__init__).parameters
    assert set(local) <= set(ray_mode)
    assert all(ray_mode[k].kind == local[k].kind and ray_mode[k].default == local[k].default for k in local)
    with pytest.raises(TypeError, match=r"RayRuntime\(tools=...\): this ToolRegistry cannot be sent to the Ray workers.*"
                       r"lock.*tools_factory"):
        RayRuntime(tools=ToolRegistry([LockedTool()]))
    with pytest.raises(TypeError, match=r"RayRuntime\(reward_fn=...\)"):
        RayRuntime(reward_fn=threading.Lock())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not both"):
        RayRuntime(tools=ToolRegistry([]), tools_factory=lambda cfg: ToolRegistry([]))
    with pytest.raises(FileNotFoundError, match="no such tools YAML file"):
        RayRuntime(tools=tmp_path / "missing.yaml")
    # A tools YAML path is every worker's (and the driver's) `agent.tools`; the caller's config is untouched.
    yml = tmp_path / "tools.yaml"
    yml.write_text("tools:\n  - class_name: agentloop.tools.builtin.CalculatorTool\n")
    cfg = RuntimeConfig()
    rt = RayRuntime(cfg, tools=str(yml), ray_config={"num_workers": 3})
    assert rt.config.agent.tools == str(yml.resolve()) and rt.tools is None and cfg.agent.tools is None
    assert rt.ray_config.num_workers == 3 and rt.config.ray.num_workers == 3 and cfg.ray.num_workers == 2
    assert RayRuntime({"ray": {"num_workers": 4}}).ray_config.num_workers == 4  # default: the config's `ray` section


def test_ray_init_keeps_the_process_sigterm_handler_and_names_bad_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentloop.config import RayConfig
    from agentloop.distributed import runtime as ray_runtime
    from agentloop.runtime import AgentloopError

    def like_ray_init(address: str | None = None, **kwargs: Any) -> None:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init does

    def no_cluster(address: str | None = None, **kwargs: Any) -> None:
        raise ConnectionError("Could not find any running Ray instance.")

    def mine(signum: int, frame: Any) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        monkeypatch.setattr(ray_runtime.ray, "init", like_ray_init)
        ray_runtime._init_ray(RayConfig())
        assert signal.getsignal(signal.SIGTERM) is mine  # the process's own handler is back
        monkeypatch.setattr(ray_runtime.ray, "init", no_cluster)
        with pytest.raises(AgentloopError, match=r"cannot start or join Ray \(ray.address='auto', ray.init_kwargs="
                           r"\{'num_cpus': 2\}\): ConnectionError: Could not find"):
            ray_runtime._init_ray(RayConfig(address="auto", init_kwargs={"num_cpus": 2}))
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_tools_given_to_ray_runtime_run_on_the_workers(ray_session: None) -> None:
    # The shipped tiny tool model, greedy, on arithmetic prompts: it calls `calculator`, which the
    # workers must run from the registry given to the driver (each worker unpickles its own copy).
    rows = [json.loads(line) for line in arithmetic_prompts().read_text().splitlines()[:3]]
    cfg = {"engine": {"local": ENGINE_LOCAL}, "scheduler": {"n": 1},
           "agent": {"sampling": {"temperature": 0.0}, "max_new_tokens_per_turn": 48, "max_assistant_turns": 3}}
    module = sys.modules[__name__]
    # The workers cannot import this test module: a worker that cannot unpickle the tools says so.
    failing = RayRuntime(cfg, tools=ToolRegistry([MarkedCalculator()]), ray_config={"num_workers": 1, "engine_num_cpus": 0})
    try:
        with pytest.raises(WorkerStartError, match=r"rollout worker 0 could not be built: .*No module named "
                           r"'test_distributed'.*importable on every node"):
            failing.start_sync()
        assert failing.processes == [] and failing.pool is None  # what it had started is stopped
    finally:
        failing.stop_sync()
    # What a user does for such a module: send its classes by value.
    ray.cloudpickle.register_pickle_by_value(module)
    try:
        with RayRuntime(cfg, tools=ToolRegistry([MarkedCalculator()]),
                        ray_config={"num_workers": 1, "engine_num_cpus": 0}) as rt:
            res = rt.step_sync(rows)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)
    results = [m["content"] for t in res.trajectories for m in t.messages if m["role"] == "tool"]
    assert results and all(c.startswith("marked ") for c in results), results
    assert {t.extra["worker"] for t in res.trajectories} == {0}


# ---------------------------------------------------------------------- Ray mode on CPU
def test_ray_mode_equals_local_mode_over_two_steps(rt: RayRuntime, local_reference: dict[str, list[Trajectory]], model_dir: Path) -> None:
    assert rt.lifecycle.state is EngineState.SLEEPING and len(rt.lifecycle.urls) == 2
    results: list[StepResult] = []
    for prefix, weights in step_weights(model_dir):
        first = len(rt.lifecycle.records)
        res = rt.step_sync(replay_samples(prefix, 3, reward="arithmetic"), weights)
        results.append(res)
        assert [r.stage for r in rt.lifecycle.records[first:] if r.phase == "wake_up"] == WAKE
        assert [r.stage for r in rt.lifecycle.records[first:] if r.phase == "sleep"] == SLEEP
        assert all(r.detail["servers"] == 2 for r in rt.lifecycle.records[first:])  # every stage on both engines
        assert rt.lifecycle.state is EngineState.SLEEPING
        assert res.metrics["status_counts"]["completed"] == 6 and res.batch["input_ids"].shape[0] == 6
        assert_same(res.trajectories, local_reference[prefix])
        assert all(t.reward is not None for t in res.trajectories)  # scored on the workers, kept by the driver
        ray_metrics = res.metrics["ray"]
        assert ray_metrics["retried"] == [] and ray_metrics["worker_generations_outside_awake"] == 0
        assert res.metrics["retried"] == [] and res.metrics["worker_deaths"] == [] and res.metrics["servers_removed"] == {}
        assert len(ray_metrics["jobs_per_worker"]) == 2  # both workers served
        groups: dict[str, set[int]] = {}
        for t in res.trajectories:
            groups.setdefault(t.group_id, set()).add(t.extra["worker"])
        assert any(len(ws) == 2 for ws in groups.values())  # a group's members are not tied to one worker
        assert {u for t in res.trajectories for u in t.extra["servers"]} == set(rt.lifecycle.urls)
        # Asleep between steps: an engine refuses generation, so a dispatch past the gate would fail loudly.
        for url in rt.lifecycle.urls:
            client = SGLangClient(url)
            with pytest.raises(EngineError, match="(?i)releas"):
                on_portal(rt, lambda: client.generate([5, 6, 7], SamplingParams(max_new_tokens=2)))
            on_portal(rt, client.close)
    assert results[0].weight_version != results[1].weight_version  # the tensors were loaded as a new version
    assert {t.weight_version for t in results[1].trajectories} == {results[1].weight_version}
    # Every worker dispatch happened while the driver's lifecycle was AWAKE (inside a gate window).
    windows = rt.lifecycle.gate_windows
    assert len(windows) == 2 and all(len(w) == 2 for w in windows)
    stats = on_portal(rt, lambda: rt.worker_stats(times=True))
    dispatches = [t for s in stats for t in s["dispatch_times"]]
    assert len(dispatches) == 2 * 6 * 2
    assert all(any(lo <= t <= hi for lo, hi in windows) for t in dispatches)
    assert {s["gate"] for s in stats} == {"SLEEPING"}


def test_work_goes_to_whichever_worker_is_free(rt: RayRuntime) -> None:
    # Worker capacity 2; input order long, short, long, short x5: a static split would give each
    # worker 4. Dispatched as slots free up, one worker holds both long trajectories and the other
    # runs every short one meanwhile.
    long_ = replay_samples("L", 2, latency=1.5)
    short = replay_samples("S", 6)
    samples = [long_[0], short[0], long_[1], *short[1:]]
    res = rt.step_sync(samples, n=1)
    assert res.metrics["status_counts"]["completed"] == 8
    assert sorted(res.metrics["ray"]["jobs_per_worker"].values()) == [2, 6]
    by_worker: dict[int, set[str]] = {}
    for t in res.trajectories:
        by_worker.setdefault(t.extra["worker"], set()).add(t.uid)
    assert {"L0", "L1"} in by_worker.values()
    # The two long ones ran side by side on that worker: their spans (one worker's clock) overlap.
    span = {t.uid: (min(e.start for e in t.timeline), max(e.end for e in t.timeline))
            for t in res.trajectories if t.uid in ("L0", "L1")}
    assert max(s for s, _ in span.values()) < min(e for _, e in span.values()), span


def test_sleep_mid_step_drains_every_worker_then_resumes(rt: RayRuntime) -> None:
    # 1000 tokens: a first turn still running when the sleep comes, 0.05 s after all four are in flight.
    spec = {"prompt_tokens": 12, "turns": [{"gen_tokens": 1000, "tool_result_tokens": 2}, {"gen_tokens": 4}]}
    samples = [Sample(uid=f"m{i}", messages=[{"role": "user", "content": "x"}], agent="replay", extra={"replay": spec})
               for i in range(2)]
    slept: list[float] = []

    def sleeper() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(s["in_flight"] for s in on_portal(rt, rt.worker_stats)) < 4:
            time.sleep(0.01)  # every trajectory has its long first turn on an engine
        time.sleep(0.05)
        on_portal(rt, rt.sleep)  # closes every worker's gate, aborts, settles the workers' requests, releases
        slept.append(time.time())

    thread = threading.Thread(target=sleeper)
    thread.start()
    res = rt.step_sync(samples)
    thread.join()
    assert slept and rt.lifecycle.state is EngineState.SLEEPING
    assert all(s["in_flight"] == 0 and s["gate"] == "SLEEPING" for s in on_portal(rt, rt.worker_stats))
    assert res.trajectories == [] and len(res.carry_over) == 4
    partial = {c.uid: c.resume_from for c in res.carry_over}
    assert all(p is not None and p.status == "aborted" and len(p.response_ids) < 1000 for p in partial.values())
    assert sum(len(p.response_ids) for p in partial.values()) > 0  # tokens sampled before the abort are kept
    res2 = rt.step_sync(res.carry_over)  # the partials continue, on whichever worker is free
    assert [t.status for t in res2.trajectories] == ["completed"] * 4
    for t in res2.trajectories:
        t.check_invariants()
        p = partial[t.uid]
        assert t.response_ids[: len(p.response_ids)] == p.response_ids and len(t.response_ids) == 1000 + 2 + 4


def test_oversampling_stops_on_every_worker_and_carries_over(rt: RayRuntime) -> None:
    quick = replay_samples("q", 2, gen=4)
    slow = replay_samples("z", 2, turns=3, gen=150)
    res = rt.step_sync(quick + slow, target_groups=2)
    assert sorted({t.group_id for t in res.trajectories}) == ["q0", "q1"]
    assert len(res.trajectories) == 4 and all(t.status == "completed" for t in res.trajectories)
    assert sorted(c.uid for c in res.carry_over) == ["z0_0", "z0_1", "z1_0", "z1_1"]
    partial = {c.uid: c.resume_from for c in res.carry_over}
    assert all(p is not None and p.status == "aborted" for p in partial.values())
    assert all(s["in_flight"] == 0 for s in on_portal(rt, rt.worker_stats))  # the stops reached the workers
    res2 = rt.step_sync(res.carry_over)
    assert sorted(t.uid for t in res2.trajectories) == sorted(partial)
    for t in res2.trajectories:
        t.check_invariants()
        p = partial[t.uid]
        assert t.status == "completed" and len(t.response_ids) == 3 * 150 + 2 * 3
        assert t.response_ids[: len(p.response_ids)] == p.response_ids


def test_killing_a_worker_mid_step_loses_nothing(rt: RayRuntime) -> None:
    samples = replay_samples("k", 3, turns=3, latency=0.4)
    killed: list[int] = []

    def killer() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            busy = [i for i, n in rt.pool.load().items() if n > 0]
            if busy:
                time.sleep(0.3)  # mid-trajectory: a model turn done, a tool call running
                killed.append(busy[0])
                ray.kill(rt.pool.handles[busy[0]], no_restart=True)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=killer)
    thread.start()
    res = rt.step_sync(samples)
    thread.join()
    assert killed, "no worker was busy"
    ray_metrics = res.metrics["ray"]
    assert res.metrics["status_counts"]["completed"] == 6 and len(res.trajectories) == 6 and not res.carry_over
    assert ray_metrics["retried"] and {r["worker"] for r in ray_metrics["retried"]} == set(killed)
    assert [d["worker"] for d in ray_metrics["worker_deaths"]] == killed
    # What was retried and what died is also at the top level of the step's metrics (the same lists).
    assert res.metrics["retried"] is ray_metrics["retried"] and res.metrics["worker_deaths"] is ray_metrics["worker_deaths"]
    assert res.metrics["servers_removed"] == {}
    assert ray_metrics["workers_replaced"] and ray_metrics["workers_alive"] == 2
    retried = {r["uid"] for r in ray_metrics["retried"]}
    assert all(t.extra["worker"] != killed[0] for t in res.trajectories if t.uid in retried)
    for t in res.trajectories:
        t.check_invariants()
    # The re-runs are the trajectories an undisturbed step produces, token for token (greedy).
    again = rt.step_sync(samples)
    assert again.metrics["ray"]["retried"] == []
    assert_same(res.trajectories, again.trajectories)


def test_dead_engine_server_is_taken_out(rt: RayRuntime) -> None:
    info = on_portal(rt, rt.engine_info)
    assert len(info) == 2 and all(i["alive"] for i in info)
    victim = info[0]
    samples = replay_samples("e", 3, turns=3, latency=0.3)

    def killer() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and rt.router.bound().get(victim["url"], 0) == 0:
            time.sleep(0.01)
        time.sleep(0.2)  # trajectories bound to it are mid-way
        os.kill(victim["pid"], signal.SIGKILL)

    thread = threading.Thread(target=killer)
    thread.start()
    res = rt.step_sync(samples)
    thread.join()
    assert res.metrics["status_counts"]["completed"] == 6
    assert victim["url"] in res.metrics["servers_removed"]
    assert res.metrics["ray"]["servers_removed"] is res.metrics["servers_removed"]
    assert res.metrics["retried"] == [] and res.metrics["worker_deaths"] == []  # a server death kills no worker
    moved = [t for t in res.trajectories if t.extra["servers"] == [victim["url"], info[1]["url"]]]
    assert moved, "some trajectories must have moved from the killed server to the other one"
    for t in res.trajectories:
        t.check_invariants()
    assert rt.lifecycle.urls == [info[1]["url"]]
    assert all(s["servers"] == [info[1]["url"]] for s in on_portal(rt, rt.worker_stats))
    # The next step wakes, rolls out and sleeps on the server that is left.
    nxt = rt.step_sync(replay_samples("f", 2))
    assert nxt.metrics["status_counts"]["completed"] == 4
    assert {u for t in nxt.trajectories for u in t.extra["servers"]} == {info[1]["url"]}
    assert rt.lifecycle.state is EngineState.SLEEPING


def test_a_server_whose_weight_version_changes_behind_the_driver_is_dropped_by_the_workers(
        ray_session: None, model_dir: Path) -> None:
    # Someone else writes a plain weight version into one of two servers mid-step (what a restart on
    # the same port looks like: no lease of the driver's in its answers). The worker's gate judges
    # every answer as the driver's does (`Fleet.answer_check`): the rogue answers are dropped, the
    # server is taken out on the worker and then on the driver, and the trajectories go on elsewhere.
    import asyncio

    # engine_num_cpus 0: the module's `rt` holds the session's two CPUs while this runs.
    runtime = RayRuntime(config(model_dir, 2), ray_config={"num_workers": 1, "worker_capacity": 4, "engine_num_cpus": 0})
    runtime.start_sync()
    try:
        first = runtime.step_sync(replay_samples("r", 2))  # step 1: both servers ours
        assert first.metrics["status_counts"]["completed"] == 4
        info = on_portal(runtime, runtime.engine_info)
        victim, other = info[0]["url"], info[1]["url"]

        def rogue() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and runtime.router.bound().get(victim, 0) == 0:
                time.sleep(0.01)
            time.sleep(0.2)  # trajectories bound to it are mid-way

            async def write() -> None:
                async with SGLangClient(victim) as c:
                    await c.update_weight_version("rogue")

            asyncio.run(write())

        thread = threading.Thread(target=rogue)
        thread.start()
        res = runtime.step_sync(replay_samples("s", 4, turns=3, latency=0.3))
        thread.join()
        version = runtime.lifecycle.weight_version
        assert res.metrics["status_counts"]["completed"] == 8
        assert {tr.weight_version for t in res.trajectories for tr in t.turns} == {version}  # no "rogue" token
        assert "by someone else" in res.metrics["servers_removed"][victim]
        assert runtime.lifecycle.urls == [other]
        assert all(s["servers"] == [other] for s in on_portal(runtime, runtime.worker_stats))
        for t in res.trajectories:
            t.check_invariants()
        # Step 3: the next wake-up finds the server held by nobody, takes it under the driver's lease
        # again, wakes it with the step's weights and admits it on every worker (no stale take-out
        # reported back by a worker puts it out again).
        nxt = runtime.step_sync(replay_samples("t", 4, turns=3))
        assert nxt.metrics["status_counts"]["completed"] == 8 and runtime.lifecycle.out_of_rotation == {}
        assert sorted(runtime.lifecycle.urls) == sorted([victim, other]) and not nxt.metrics["servers_removed"]
        assert all(sorted(s["servers"]) == sorted([victim, other]) for s in on_portal(runtime, runtime.worker_stats))
        assert {tr.weight_version for t in nxt.trajectories for tr in t.turns} == {runtime.lifecycle.weight_version}
        assert victim in {u for t in nxt.trajectories for u in t.extra["servers"]}
    finally:
        runtime.stop_sync()
