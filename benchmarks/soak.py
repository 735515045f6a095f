"""Chaos soak: many `Runtime` steps on the CPU engine with faults injected at random, counting
every sample and watching the process's resources.

Two `agentloop serve` processes run the shipped tiny tool model (which really calls its calculator);
the runtime reaches the first through a loopback TCP proxy. Faults, drawn from one seed:
- tools (per call): hang, raise (ValueError, SystemExit, KeyboardInterrupt, CancelledError), flood
  (10 MB), stream without end, ignore cancellation, block the thread (`time.sleep`), a result whose
  `__str__` fails — the hostile tool stands in for the calculator, in the runtime's process (inline);
  and, in a tool worker process (issue 29), `os._exit`, a GIL hog (one 2e9-step C call), a leftover
  spinning non-daemon thread, a forked child that outlives the call (`hostile_tools.py`);
- the OpenAI endpoint (per step): a 60 MiB valid chat request to a trajectory's endpoint served on the
  runtime's event loop, during the step (must be refused at once, the step going on);
- bad rows (per step): an empty conversation, a message without content, an unknown role, an unknown
  agent loop, a prompt longer than the context;
- network (per step): the proxy delays every chunk (a slow network) or resets connections;
- servers (per step, `--server-faults`): the second server killed and restarted (on its port, after
  the step), or paused (SIGSTOP) for a few seconds, mid-step; each step records how many servers are
  in rotation when it ends.

Reported: faults injected by kind; per step the samples launched and how each is accounted for
(completed, truncated, aborted, failed with a reason, carried over to the next step) and how many are
lost (launched but neither returned nor carried, or failed without a reason: must be 0); steps
completed; and, sampled over time, the process's RSS, open file descriptors, live asyncio tasks,
threads and abandoned tool calls (curves that must stay flat). `--smoke` is a few steps that still
inject tool faults (the first calls misbehave, each kind in turn), bad rows and a slow network (CI
runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, run_benchmark  # noqa: E402

INLINE_FAULTS = ("hang", "raise_value_error", "raise_system_exit", "raise_keyboard_interrupt", "raise_cancelled",
                 "flood_10mb", "endless_stream", "ignore_cancellation", "block_thread", "bad_str")
PROCESS_FAULTS = ("process_exit", "gil_hog", "spin_thread", "fork_child")
TOOL_FAULTS = INLINE_FAULTS + PROCESS_FAULTS
ENDPOINT_FAULTS = ("huge_endpoint_request",)
ROW_FAULTS = ("empty_messages", "no_content", "unknown_role", "unknown_agent", "too_long")
NET_FAULTS = ("slow_network", "connection_reset")
SERVER_FAULTS = ("kill_restart", "pause")
ACCOUNTED = ("completed", "truncated", "aborted", "failed")

DEFINITIONS = {
    "faults_injected": "faults by kind over the run (tool faults count calls, row faults rows, network and "
                       "server faults steps)",
    "lost": "samples launched but neither returned as a trajectory nor carried over to the next step, plus "
            "failed trajectories without an error message",
    "accounted": "returned trajectories by status (failed ones all carry their reason) and samples carried over",
    "resources": "sampled every --sample-every seconds: RSS (MB), open fds, live asyncio tasks, threads, "
                 "tool calls abandoned whose thread still runs, tool worker processes alive (forked leftovers included)",
    "endpoint_refusals": "per step: status, error code and seconds of the 60 MiB endpoint request (400 "
                         "context_length_exceeded in well under a second)",
    "growth": "last tenth of the run minus first tenth (means of the step-boundary samples)",
    "rss_trimmed_mb": "RSS at a step's end after malloc_trim(0): memory still in use, without the free heap pages "
                      "glibc keeps",
    "growth_second_half": "last tenth minus the tenth that ends the first half (after warm-up)",
}


# ------------------------------------------------------------------ command line
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["cpu"], default="cpu", help="the CPU engine (the soak starts two servers)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG results")
    p.add_argument("--smoke", action="store_true", help="two short steps with tool, row and network faults (CI)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompts", type=int, default=8, help="dataset prompts per step (plus bad rows)")
    p.add_argument("--n", type=int, default=2, help="trajectories per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tool-fault-rate", type=float, default=0.3, help="probability a tool call misbehaves")
    p.add_argument("--row-fault-rate", type=float, default=0.5, help="probability a step carries bad rows")
    p.add_argument("--net-fault-rate", type=float, default=0.3, help="probability of a network fault in a step")
    p.add_argument("--server-fault-rate", type=float, default=0.15, help="probability of a server fault in a step")
    p.add_argument("--endpoint-fault-rate", type=float, default=0.3,
                   help="probability of a 60 MiB request to an OpenAI endpoint in a step")
    p.add_argument("--server-faults", action=argparse.BooleanOptionalAction, default=True,
                   help="kill/restart and pause the second server mid-step")
    p.add_argument("--tool-timeout", type=float, default=1.0)
    p.add_argument("--trajectory-timeout", type=float, default=60.0)
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument("--sample-every", type=float, default=0.5)
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.prompts, args.n = 2, 3, 1
        args.server_faults, args.net_fault_rate, args.row_fault_rate, args.endpoint_fault_rate = False, 1.0, 1.0, 1.0
    return args


# ------------------------------------------------------------------ faults
class FaultLog:
    """Faults injected, by kind (tools run in threads: counted under a lock)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1


class _BadStr:
    def __str__(self) -> str:
        raise ValueError("this result has no text")


class Chooser:
    """Draws each tool call's fault (None: it behaves) and counts it; with `smoke`, each kind in turn
    first (the process faults early: they are the costly ones to miss)."""

    def __init__(self, faults: FaultLog, rate: float, seed: int, smoke: bool) -> None:
        self.faults, self.rate, self.smoke = faults, rate, smoke
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.order = ["hang", "raise_value_error", *PROCESS_FAULTS,
                      *[k for k in INLINE_FAULTS if k not in ("hang", "raise_value_error")]]

    def draw(self) -> str | None:
        with self.lock:
            if self.smoke and self.order:
                kind: str | None = self.order.pop(0)
            else:
                kind = self.rng.choice(TOOL_FAULTS) if self.rng.random() < self.rate else None
        if kind is not None:
            self.faults.add(kind)
        return kind


def chaos_calculator() -> Any:
    """The calculator, misbehaving in the runtime's process when its call carries an inline fault."""
    from agentloop.tools import ToolContext
    from agentloop.tools.builtin import CalculatorTool

    class ChaosCalculator(CalculatorTool):
        def execute(self, arguments: dict[str, Any], context: ToolContext) -> Any:  # type: ignore[override]
            kind = arguments.pop("_chaos", None)
            if kind is None:
                return CalculatorTool.execute(self, arguments, context)  # awaited in the call's own loop
            return _misbehave(kind)

    return ChaosCalculator()


def soak_tools(chooser: Chooser, gil_n: int) -> Any:
    """The soak's registry: the model sees one `calculator`; each call is given its fault here (in the
    runtime, where faults are counted) and a call drawn for a process fault goes to the calculator's
    twin in a tool worker process (`hostile_tools.ChaosWorkerCalculator`, loaded by module path like
    any YAML tool), the others to the inline chaos calculator."""
    from agentloop.tools import ToolCall, ToolRegistry

    class SoakTools(ToolRegistry):
        def schemas(self, names: Any = None) -> list[dict[str, Any]]:
            return super().schemas(["calculator"] if names is None else names)

        async def execute_calls(self, calls: Any, **kw: Any) -> Any:
            routed = []
            for c in calls:
                kind = chooser.draw() if c.error is None and c.name == "calculator" else None
                if kind is not None:
                    name = "calculator_in_worker" if kind in PROCESS_FAULTS else c.name
                    c = ToolCall(name, {**(c.arguments or {}), "_chaos": kind}, c.raw, c.error, c.id)
                routed.append(c)
            results = await super().execute_calls(routed, **kw)
            for r in results:
                r.name = "calculator" if r.name == "calculator_in_worker" else r.name
            return results

    reg = SoakTools([chaos_calculator()])
    twin = {"class_name": "hostile_tools.ChaosWorkerCalculator", "config": {"gil_n": gil_n}}
    from agentloop.tools.tool_config import build_entry

    tool, function = build_entry(twin, "soak twin")
    reg.add(tool, where="soak twin", function=function, entry=twin)
    return reg


@functools.lru_cache(maxsize=1)
def _huge_body(size: int) -> bytes:
    """One valid chat request of about `size` bytes, built once for the run (the soak measures the
    endpoint, not its own allocations)."""
    return b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * size + b'"}]}'


async def huge_endpoint_request(server: Any, tokenizer: Any, size: int) -> dict[str, Any]:
    """A `size`-byte valid chat request to a trajectory's OpenAI endpoint served on this event loop."""
    import aiohttp

    from agentloop.agents.base import AgentConfig, AgentContext
    from agentloop.endpoint import TrajectoryRecorder
    from agentloop.types import Sample

    async def never(input_ids: Any, params: Any) -> Any:
        raise AssertionError("a request that cannot fit must never reach the engine")

    ctx = AgentContext(generate=never, tokenizer=tokenizer, config=AgentConfig(max_context_tokens=2048))
    rec = TrajectoryRecorder(Sample(uid="huge", messages=[{"role": "user", "content": "hi"}]), ctx)
    body = _huge_body(size)
    with server.open(rec) as route:
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{route.base_url}/chat/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as r:
                answer = await r.json(content_type=None)
                status = r.status
    return {"status": status, "code": (answer.get("error") or {}).get("code"), "seconds": round(time.monotonic() - t0, 3),
            "rendered": bool(rec.segments)}


def _misbehave(kind: str) -> Any:
    if kind == "hang":
        return anyio.sleep(3600)  # awaited in the call's own loop
    if kind.startswith("raise_"):
        raise {"raise_value_error": ValueError("chaos"), "raise_system_exit": SystemExit(3),
               "raise_keyboard_interrupt": KeyboardInterrupt(), "raise_cancelled": asyncio.CancelledError()}[kind]
    if kind == "flood_10mb":
        return "0123456789" * 1_000_000
    if kind == "endless_stream":
        def endless() -> Any:
            while True:
                yield "y" * 65536
        return endless()
    if kind == "ignore_cancellation":
        async def shielded() -> str:
            end = time.monotonic() + 8.0
            while time.monotonic() < end:  # swallows every cancellation for 8 s, then returns
                try:
                    await asyncio.sleep(end - time.monotonic())
                except asyncio.CancelledError:
                    continue
            return "late"
        return shielded()
    if kind == "block_thread":
        time.sleep(5)
        return "late"
    if kind == "bad_str":
        return _BadStr()
    raise AssertionError(kind)


def bad_rows(step: int, rng: random.Random, faults: FaultLog, smoke: bool) -> list[Any]:
    from agentloop.types import Sample

    kinds = list(ROW_FAULTS) if smoke else rng.sample(ROW_FAULTS, rng.randint(1, 2))
    rows = []
    for kind in kinds:
        uid = f"bad{step}-{kind}"
        msgs: list[dict[str, Any]] = {
            "empty_messages": [],
            "no_content": [{"role": "user"}],
            "unknown_role": [{"role": "wizard", "content": "What is 2 + 2?"}],
            "unknown_agent": [{"role": "user", "content": "What is 2 + 2?"}],
            "too_long": [{"role": "user", "content": "What is 2 + 2? " * 3000}],
        }[kind]
        rows.append(Sample(uid=uid, messages=msgs, agent="no_such_agent" if kind == "unknown_agent" else None))
        faults.add(f"row_{kind}")
    return rows


class Proxy:
    """A loopback TCP proxy in front of one server: `delay` seconds before each forwarded chunk (a slow
    network), `reset` closes connections as they come (a flaky one)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.delay = 0.0
        self.reset = False
        self.port = 0

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        task_status.started()
        await listener.serve(self._handle)

    async def _handle(self, client: Any) -> None:
        async with client:
            if self.reset:
                return
            try:
                upstream = await anyio.connect_tcp("127.0.0.1", self.upstream_port)
            except OSError:
                return  # the server is down: the client sees a closed connection
            async with upstream, anyio.create_task_group() as tg:
                async def pipe(src: Any, dst: Any) -> None:
                    try:
                        async for chunk in src:
                            if self.delay:
                                await anyio.sleep(self.delay)
                            await dst.send(chunk)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(pipe, client, upstream)
                tg.start_soon(pipe, upstream, client)


# ------------------------------------------------------------------ resources
def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def tool_workers() -> int:
    """Live tool worker processes of this run (and anything forked from one: same command line)."""
    from agentloop.tools.worker_pool import _descendants

    n = 0
    for pid in _descendants(os.getpid()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"agentloop.tools.worker_main" in cmd and state not in ("Z", "X"):
            n += 1
    return n


def trimmed_rss_mb() -> float:
    """RSS once glibc has given its free heap pages back (malloc_trim): what is still in use, so that
    growth of this curve is memory held, and growth of `rss_mb` alone is the allocator keeping pages."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return round(_rss_mb(), 1)


def resources(t0: float) -> dict[str, Any]:
    from agentloop.tools.call_thread import abandoned_calls

    return {"t": round(time.monotonic() - t0, 3), "rss_mb": round(_rss_mb(), 1), "fds": len(os.listdir("/proc/self/fd")),
            "tasks": len(asyncio.all_tasks()), "threads": threading.active_count(), "abandoned_tool_calls": abandoned_calls(),
            "tool_workers": tool_workers()}


# ------------------------------------------------------------------ the run
def _signal_group(proc: Any, sig: int) -> bool:
    p = getattr(proc, "_proc", None)  # LocalEngineProcess keeps its Popen private; its group is its own session
    if p is None or p.poll() is not None:
        return False
    os.killpg(p.pid, sig)
    return True


async def measure(args: argparse.Namespace, save: Any) -> dict[str, Any]:
    from agentloop.data import arithmetic_prompts
    from agentloop.dataset import load_dataset
    from agentloop.engine.local.process import LocalEngineProcess
    from agentloop.engine.sglang import SGLangClient
    from agentloop.models import tiny_tool_model
    from agentloop.runtime import Runtime
    from agentloop.runtime.types import StepError
    from agentloop.endpoint import EndpointServer

    # A hostile tool's exception is logged with its traceback by the registry: thousands here, on purpose.
    logging.getLogger("agentloop.tools.registry").setLevel(logging.ERROR)
    rng = random.Random(args.seed)
    faults = FaultLog()
    model = tiny_tool_model()
    prompts = load_dataset(arithmetic_prompts()).samples
    engine_args = ["--num-threads", "1", "--log-level", "warning"]
    a = LocalEngineProcess(model, extra_args=engine_args)
    b = LocalEngineProcess(model, extra_args=engine_args)
    async with anyio.create_task_group() as starting:
        for p in (a, b):
            starting.start_soon(p.start, 180)
    servers = {"b": b}
    proxy = Proxy(a.port)
    t0 = time.monotonic()
    samples: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    out: dict[str, Any] = {}
    cfg = {
        "engine": {"urls": [], "tokenizer": str(model), "request_timeout": args.request_timeout},
        "scheduler": {"n": args.n, "concurrency": 64, "trajectory_timeout": args.trajectory_timeout, "abort_grace": 3.0},
        "agent": {"sampling": {"temperature": 1.0}, "tool_timeout": args.tool_timeout, "max_assistant_turns": 3,
                  "max_new_tokens_per_turn": 48, "max_response_tokens": 384, "max_context_tokens": 2048},
    }
    tools = soak_tools(Chooser(faults, args.tool_fault_rate, args.seed + 1, args.smoke), gil_n=2_000_000_000)
    endpoint = await EndpointServer().start()

    def report(complete: bool = False) -> dict[str, Any]:
        lost = sum(s["lost"] for s in steps)
        first = [s["resources"] for s in steps[: max(1, len(steps) // 10)]]
        last = [s["resources"] for s in steps[-max(1, len(steps) // 10):]]

        def growth(key: str) -> float | None:
            if not steps:
                return None
            return round(sum(r[key] for r in last) / len(last) - sum(r[key] for r in first) / len(first), 2)

        def half_growth(key: str) -> float | None:
            """After warm-up: the last tenth minus the tenth that ends the first half."""
            n = len(steps)
            if n < 10:
                return None
            mid = [s["resources"][key] for s in steps[n // 2 - n // 10: n // 2]]
            return round(sum(r[key] for r in last) / len(last) - sum(mid) / len(mid), 2)

        out.update({
            "steps_requested": args.steps,
            "steps_completed": sum(1 for s in steps if s["error"] is None),
            "steps_raised": sum(1 for s in steps if s["error"] is not None),
            "faults_injected": dict(sorted(faults.counts.items())),
            "faults_total": sum(faults.counts.values()),
            "samples_launched": sum(s["launched"] for s in steps),
            "accounted": {k: sum(s["accounted"].get(k, 0) for s in steps) for k in (*ACCOUNTED, "carried_over")},
            "lost": lost,
            "growth": {k: growth(k) for k in ("rss_mb", "rss_trimmed_mb", "fds", "tasks", "threads", "abandoned_tool_calls",
                                              "tool_workers")},
            "growth_second_half": {k: half_growth(k) for k in ("rss_mb", "rss_trimmed_mb", "fds", "tasks", "threads",
                                                               "tool_workers")},
            "max": {k: max((r[k] for r in samples), default=None) for k in ("rss_mb", "fds", "tasks", "threads",
                                                                            "abandoned_tool_calls", "tool_workers")},
            "endpoint_refusals": [s["endpoint"] for s in steps if s.get("endpoint")],
            "tool_workers_at_end": tool_workers(),
            "per_step": steps,
            "resources": samples,
        })
        return out

    async def sampler() -> None:
        while True:
            samples.append(resources(t0))
            await anyio.sleep(args.sample_every)

    async def server_fault(kind: str, delay: float) -> None:
        await anyio.sleep(delay)
        if kind == "pause":
            if _signal_group(servers["b"], signal.SIGSTOP):
                await anyio.sleep(3.0)
                _signal_group(servers["b"], signal.SIGCONT)
        else:
            _signal_group(servers["b"], signal.SIGKILL)

    try:
        async with anyio.create_task_group() as tg:
            await tg.start(proxy.serve)
            tg.start_soon(sampler)
            clients = [SGLangClient(f"http://127.0.0.1:{proxy.port}"), SGLangClient(b.url)]
            async with Runtime(cfg, clients=clients, tools=tools) as rt:
                carry: list[Any] = []
                for step in range(1, args.steps + 1):
                    injected: list[str] = []
                    proxy.delay, proxy.reset = 0.0, False
                    if rng.random() < args.net_fault_rate:
                        kind = "slow_network" if (args.smoke or rng.random() < 0.8) else "connection_reset"
                        if kind == "slow_network":
                            proxy.delay = rng.uniform(0.02, 0.2)
                        else:
                            proxy.reset = True
                        faults.add(kind)
                        injected.append(kind)
                    fresh = [prompts[(step * args.prompts + i) % len(prompts)] for i in range(args.prompts)]
                    fresh = [dataclasses.replace(s, uid=f"s{step}-{s.uid}") for s in fresh]
                    rows = bad_rows(step, rng, faults, args.smoke) if rng.random() < args.row_fault_rate else []
                    injected += [f"row_{r.uid.split('-', 1)[1]}" for r in rows]
                    batch = carry + fresh + rows
                    launched = sum(1 if s.group_id else args.n for s in batch)
                    huge = rng.random() < args.endpoint_fault_rate
                    if huge:
                        faults.add("huge_endpoint_request")
                        injected.append("huge_endpoint_request")
                    endpoint_result: dict[str, Any] = {}
                    server_kind = None
                    if args.server_faults and rng.random() < args.server_fault_rate:
                        server_kind = rng.choice(SERVER_FAULTS)
                        faults.add(server_kind)
                        injected.append(server_kind)
                    t_step = time.monotonic()
                    error = None
                    trajs: list[Any] = []
                    carried: list[Any] = []
                    async def endpoint_fault(delay: float) -> None:
                        await anyio.sleep(delay)  # mid-step: the step's trajectories share this event loop
                        endpoint_result.update(await huge_endpoint_request(endpoint, rt.tokenizer, 60 << 20))

                    async with anyio.create_task_group() as ftg:
                        if server_kind is not None:
                            ftg.start_soon(server_fault, server_kind, rng.uniform(0.3, 1.5))
                        if huge:
                            ftg.start_soon(endpoint_fault, rng.uniform(0.2, 1.0))
                        try:
                            res = await rt.step(batch)
                            trajs, carried = list(res.trajectories), list(res.carry_over)
                        except StepError as e:  # the rollout is on the exception
                            error = f"{type(e).__name__}: {e}"
                            trajs, carried = list(e.trajectories), list(e.carry_over)
                        except Exception as e:  # noqa: BLE001 - reported: its samples count as lost
                            error = f"{type(e).__name__}: {e}"
                    if server_kind == "kill_restart":  # back on the same port for the next step
                        old = servers["b"]
                        if getattr(old, "_proc", None) is not None:
                            old._proc.wait()
                        fresh_b = LocalEngineProcess(model, port=old.port, extra_args=engine_args)
                        await fresh_b.start(timeout=180)
                        servers["b"] = fresh_b
                    last = step == args.steps
                    carry = [] if last else carried
                    statuses = Counter(t.status for t in trajs)
                    if last:  # nothing continues them: they are accounted as the aborted partial results they are
                        statuses["aborted"] += len(carried)
                    silent = sum(1 for t in trajs if t.status == "failed" and not t.error)
                    accounted = {k: statuses.get(k, 0) for k in ACCOUNTED}
                    accounted["carried_over"] = 0 if last else len(carried)
                    unknown = sum(v for k, v in statuses.items() if k not in ACCOUNTED)
                    lost = max(0, launched - sum(accounted.values())) + silent + unknown
                    steps.append({
                        "step": step, "seconds": round(time.monotonic() - t_step, 3), "faults": injected,
                        "launched": launched, "accounted": accounted, "lost": lost, "error": error,
                        "failed_reasons": dict(Counter((t.error or "")[:80] for t in trajs if t.status == "failed")),
                        "tool_errors": int(sum(t.metrics.get("tool_errors", 0) for t in trajs)),
                        # Servers in rotation as the step ends (a killed one is taken out, a restarted one re-admitted).
                        "servers_in_rotation": len(rt.lifecycle.urls),
                        "endpoint": endpoint_result or None,
                        "resources": {**resources(t0), "rss_trimmed_mb": trimmed_rss_mb()},
                    })
                    print(f"step {step}/{args.steps}: {launched} launched, {dict(accounted)}, lost {lost}, "
                          f"faults {injected}, {steps[-1]['seconds']:.1f}s, rss {steps[-1]['resources']['rss_mb']} MB, "
                          f"fds {steps[-1]['resources']['fds']}, tasks {steps[-1]['resources']['tasks']}"
                          + (f", step error: {error[:200]}" if error else ""), flush=True)
                    save(report())
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await endpoint.close()
            tools.close()
            for p in (a, servers["b"]):
                await p.stop()
    return report(complete=True)


# ------------------------------------------------------------------ plot
def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["resources"]
    t = [r["t"] for r in res]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    axes[0].plot(t, [r["rss_mb"] for r in res])
    axes[0].set_ylabel("RSS (MB)")
    axes[1].plot(t, [r["fds"] for r in res], label="open fds")
    axes[1].plot(t, [r["threads"] for r in res], label="threads")
    axes[1].plot(t, [r["abandoned_tool_calls"] for r in res], label="abandoned tool calls (thread alive)")
    axes[1].plot(t, [r.get("tool_workers", 0) for r in res], label="tool worker processes")
    axes[1].step([s["resources"]["t"] for s in report["per_step"]], [s["servers_in_rotation"] for s in report["per_step"]],
                 where="post", label="servers in rotation (step end)")
    axes[1].legend(loc="upper left", fontsize=8)
    axes[2].plot(t, [r["tasks"] for r in res], label="live asyncio tasks")
    axes[2].legend(loc="upper left", fontsize=8)
    ends = [s["resources"]["t"] for s in report["per_step"]]
    for k, color in zip(("completed", "truncated", "aborted", "failed", "carried_over"),
                        ("tab:green", "tab:blue", "tab:orange", "tab:red", "tab:gray")):
        axes[3].plot(ends, [s["accounted"][k] for s in report["per_step"]], ".-", color=color, label=k)
    axes[3].plot(ends, [s["lost"] for s in report["per_step"]], "kx-", label="lost")
    axes[3].set_ylabel("samples per step")
    axes[3].legend(loc="upper left", fontsize=8, ncol=3)
    axes[3].set_xlabel("seconds")
    fig.suptitle(f"chaos soak: {report['steps_completed']}/{report['steps_requested']} steps, "
                 f"{report['faults_total']} faults injected, {report['lost']} samples lost")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from agentloop.allocator import tune_allocator

    tune_allocator()  # this process is the runtime's owner, as `agentloop bench soak`'s is (agentloop.cli)
    return run_benchmark("soak", argv, parse_args, DEFINITIONS, measure, plot, checkpoints=True)


if __name__ == "__main__":
    raise SystemExit(main())
