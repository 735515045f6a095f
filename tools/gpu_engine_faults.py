"""Issue #14 on real SGLang, one GPU: servers that are attached to again and again, runtimes that are
SIGKILLed, servers that die between steps. Writes JSON as it goes.

    python tools/gpu_engine_faults.py OUT_DIR                # SGLang on the GPU (needs sglang + CUDA)
    python tools/gpu_engine_faults.py OUT_DIR --dry-run      # the CPU engine stands in (debug the script)

What it does, with the shipped tiny tool model (`agentloop.models.tiny_tool_model()`) served by
`sglang.launch_server` through `agentloop.engine.launch` (memory saver on, as agentloop launches it):

1. `consecutive_runs`: one server; three `agentloop rollout --engine-url URL --steps 2` runs in a
   row, greedy (`--temperature 0`); their summaries must agree (statuses, tokens, tool calls,
   rewards) and the server must be alive and awake after each (the first run of issue #14 left it
   asleep and the second crashed it with a double release).
2. `sigkill_mid_step`: on the same server, a rollout run is SIGKILLed while its first step rolls
   out (the server's weight version shows it went asleep at start-up and is awake again); a new `agentloop rollout --engine-url URL` run must then
   complete on the same server, and the server must still be alive.
3. `two_servers_one_killed`: two servers on the GPU (`--mem-fraction` each); a `Runtime` over both
   runs a step, one server's process group is SIGKILLed between steps, the next step must complete
   on the other one (metrics name the dead one), the server is restarted on its port, and the step
   after must re-admit it and use both.
4. `second_attach`: on the first server, a `Runtime` (A) runs a step; while its second step rolls
   out, `agentloop rollout --engine-url URL` (B) is started: B must be refused, naming A's lease and
   `engine.takeover`, A's step must complete untouched (0 failed, plain weight versions in its
   trajectories), and once A stops the server must be awake with its plain version.
5. `launcher_sigkilled`: `python -m agentloop.engine.launch` starts a server and is SIGKILLed; the
   server and every process of its group (scheduler, detokenizer) must be gone, and the GPU memory
   they held freed, within 60 s (`agentloop.engine.tether`).

OUT_DIR/gpu_engine_faults.json is rewritten after every stage (so a run cut short keeps what it
measured) with per-stage results and `checks`; server logs' tails go to OUT_DIR/gpu_engine_faults.log.
Exit code 0 only if every check holds. Expected on an H200: ~1-2 min per server start (three starts,
the two-server one concurrent), ~6 min in all; the dry run takes ~3 min on 2 CPU cores.

On the GPU host, from the repo root (sglang installed, e.g. `source tools/gpu/install_on_device.sh`):
    PYTHONPATH=src python3 tools/gpu_engine_faults.py benchmarks/results/gpu_engine_faults
    PYTHONPATH=src python3 tools/gpu_engine_faults.py OUT --stages two_servers_one_killed   # stage 3 alone
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import anyio

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

#: Summary fields that must agree between greedy runs (timings differ run to run).
SAME_FIELDS = ("steps", "trajectories", "status", "tool_calls", "trajectories_with_tool_call", "reward_mean",
               "generated_tokens")


class Results:
    """The JSON document, written after every change."""

    def __init__(self, out_dir: Path, dry_run: bool) -> None:
        self.path = out_dir / "gpu_engine_faults.json"
        self.doc: dict[str, Any] = {
            "command": " ".join([sys.executable, *sys.argv]), "dry_run": dry_run,
            "note": "DRY RUN: the CPU engine stood in for SGLang; not GPU results" if dry_run else "",
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "stages": {}, "checks": {},
        }
        self.save()

    def stage(self, name: str, **data: Any) -> None:
        self.doc["stages"].setdefault(name, {}).update(data)
        self.save()

    def check(self, name: str, ok: bool) -> bool:
        self.doc["checks"][name] = bool(ok)
        self.save()
        return bool(ok)

    def save(self) -> None:
        self.path.write_text(json.dumps(self.doc, indent=1, default=str))


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def rollout_argv(url: str, out: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "agentloop", "rollout", "--engine-url", url, "--out", str(out), "--steps", str(steps),
            "--prompts-per-step", "16", "--n", "2", "--temperature", "0", "-q", "--no-timeline"]


def comparable(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary.get(k) for k in SAME_FIELDS}


class Server:
    """One engine server: SGLang on the GPU, or (dry run) the CPU engine; restartable on its port."""

    def __init__(self, model: Path, dry_run: bool, mem_fraction: float, port: int | None = None) -> None:
        self.model, self.dry_run, self.mem_fraction, self.port = model, dry_run, mem_fraction, port
        self.proc: Any = None

    async def start(self, timeout: float) -> str:
        if self.dry_run:
            from agentloop.engine.local.process import LocalEngineProcess

            self.proc = LocalEngineProcess(self.model, port=self.port)
        else:
            from agentloop.engine.launch import SGLangLaunchConfig, SGLangServer

            self.proc = SGLangServer(SGLangLaunchConfig(model_path=str(self.model), port=self.port,
                                                        mem_fraction_static=self.mem_fraction))
        url = await self.proc.start(timeout=timeout)
        self.port = int(url.rsplit(":", 1)[1])
        return url

    @property
    def pid(self) -> int:
        return self.proc._proc.pid if self.dry_run else self.proc.pid

    def kill(self) -> None:
        """SIGKILL the server (its whole process group for SGLang: scheduler and detokenizer too)."""
        if self.dry_run:
            os.kill(self.pid, signal.SIGKILL)
        else:
            os.killpg(self.pid, signal.SIGKILL)

    def alive(self) -> bool:
        p = self.proc._proc if self.dry_run else self.proc.proc
        return p is not None and p.poll() is None

    def log_tail(self) -> str:
        return self.proc.log_tail(30)

    async def stop(self) -> None:
        if self.proc is not None and self.alive():
            await self.proc.stop()


async def server_state(url: str) -> dict[str, Any]:
    from agentloop.engine.sglang import SGLangClient

    async with SGLangClient(url, timeout=10) as c:
        try:
            info = await c.model_info()
        except Exception as e:  # dead: say how
            return {"alive": False, "error": f"{type(e).__name__}: {e}"}
        return {"alive": True, "weight_version": info.get("weight_version")}


def gpu_used_gib() -> float | None:
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            return round((total - free) / 2**30, 3)
    except Exception:
        pass
    return None


async def consecutive_runs(res: Results, url: str, work: Path, runs: int) -> None:
    summaries = []
    for i in range(runs):
        out = work / f"run{i}"
        t0 = time.monotonic()
        done = await anyio.to_thread.run_sync(lambda: subprocess.run(
            rollout_argv(url, out, 2), capture_output=True, text=True, env=env(), timeout=600))
        state = await server_state(url)
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
        summaries.append(summary)
        res.stage("consecutive_runs", **{f"run{i}": {
            "exit_code": done.returncode, "seconds": round(time.monotonic() - t0, 2), "server_after": state,
            "gpu_used_gib_after": gpu_used_gib(), "summary": comparable(summary) if summary else None,
            "stderr_tail": done.stderr[-1500:]}})
        res.check(f"consecutive_run{i}_ok", done.returncode == 0 and state["alive"])
        res.check(f"consecutive_run{i}_left_awake", state.get("weight_version") == "default")
    ok = all(s is not None for s in summaries) and all(comparable(s) == comparable(summaries[0]) for s in summaries)
    res.check("consecutive_runs_identical_summaries", ok)


async def sigkill_mid_step(res: Results, url: str, work: Path) -> None:
    from agentloop.engine.lifecycle import MemoryMark
    from agentloop.engine.sglang import SGLangClient

    out = work / "killed"
    proc = subprocess.Popen(rollout_argv(url, out, 3), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env())
    # Mid-step = the server went asleep (the run's start-up sleep marks its weight version) and then
    # awake again (step 1's wake-up ended with the plain version): the step is rolling out.
    seen_asleep, killed_mid_step, version = False, False, None
    deadline = time.monotonic() + 300
    async with SGLangClient(url, timeout=10) as client:
        while time.monotonic() < deadline and proc.poll() is None:
            version = str((await client.model_info()).get("weight_version"))
            asleep = bool(MemoryMark.decode(version).released)
            if seen_asleep and not asleep:
                await anyio.sleep(0.3)  # requests in flight
                version = str((await client.model_info()).get("weight_version"))
                killed_mid_step = proc.poll() is None and not MemoryMark.decode(version).released
                break
            seen_asleep = seen_asleep or asleep
            await anyio.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stream = out / "trajectories.jsonl"
    lines = len(stream.read_text().splitlines()) if stream.exists() else 0
    await anyio.sleep(1.0)
    state = await server_state(url)
    res.stage("sigkill_mid_step", killed_after_trajectories=lines, killed_mid_step=killed_mid_step,
              weight_version_at_kill=version, server_after_kill=state)
    res.check("sigkill_hit_mid_step", killed_mid_step)
    res.check("server_alive_after_sigkill", state["alive"])
    out2 = work / "after_kill"
    done = await anyio.to_thread.run_sync(lambda: subprocess.run(
        rollout_argv(url, out2, 2), capture_output=True, text=True, env=env(), timeout=600))
    summary = json.loads((out2 / "summary.json").read_text()) if (out2 / "summary.json").exists() else None
    state = await server_state(url)
    res.stage("sigkill_mid_step", next_run_exit_code=done.returncode, next_run_summary=comparable(summary) if summary else None,
              server_after_next_run=state, next_run_stderr_tail=done.stderr[-1500:])
    res.check("next_run_after_sigkill_ok", done.returncode == 0 and summary is not None
              and summary["status"].get("failed", 0) == 0 and state["alive"])


async def second_attach(res: Results, url: str, model: Path, work: Path) -> None:
    from agentloop.data import arithmetic_prompts
    from agentloop.runtime import Runtime

    rows = [json.loads(x) for x in arithmetic_prompts().read_text().splitlines() if x.strip()]
    cfg = {"engine": {"urls": [url], "tokenizer": str(model)}, "scheduler": {"n": 2, "concurrency": 64},
           "agent": {"sampling": {"temperature": 0.0}}}
    b_done: list[subprocess.CompletedProcess[str]] = []
    async with Runtime(cfg) as a:
        r1 = await a.step([dict(r, uid=f"a1-{i}") for i, r in enumerate(rows[:16])])

        async def b_mid_step() -> None:
            await a.lifecycle.gate.wait_awake(300)
            b_done.append(await anyio.to_thread.run_sync(lambda: subprocess.run(
                rollout_argv(url, work / "second", 1), capture_output=True, text=True, env=env(), timeout=600)))
            b_done_at.append(time.monotonic())

        b_done_at: list[float] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(b_mid_step)
            r2 = await a.step([dict(r, uid=f"a2-{i}") for i, r in enumerate(rows[16:32] * 4)])
            a_step2_done_at = time.monotonic()
        held = await server_state(url)
        owner = a.lifecycle.lease.owner
    b = b_done[0]
    versions = sorted({v for r in (r1, r2) for t in r.trajectories for v in t.weight_versions})
    after = await server_state(url)
    res.stage("second_attach", a_steps=[r1.metrics["status_counts"], r2.metrics["status_counts"]],
              a_trajectory_weight_versions=versions, server_while_a_holds=held, a_owner=owner,
              b_exit_code=b.returncode, b_stderr_tail=b.stderr[-1500:], server_after_a_stopped=after,
              b_refused_while_a_mid_step=b_done_at[0] < a_step2_done_at)
    res.check("second_attach_refused_naming_owner", b.returncode != 0 and "another runtime drives this server now" in b.stderr
              and owner.rsplit(":", 1)[1] in b.stderr and "engine.takeover" in b.stderr)
    res.check("first_runtime_untouched", r2.metrics["status_counts"].get("failed", 0) == 0
              and r1.metrics["status_counts"].get("failed", 0) == 0 and versions == ["default"])
    res.check("server_awake_and_free_after_first_stops", after == {"alive": True, "weight_version": "default"})


def _group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(d.name))
    return pids


def _children(ppid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                    out.append(int(d.name))
            except OSError:
                continue
    return out


async def launcher_sigkilled(res: Results, model: Path, args: argparse.Namespace, work: Path) -> None:
    ready = work / "launcher.url"
    used_before = gpu_used_gib()
    if args.dry_run:  # the CPU engine, through the same tether
        argv = [sys.executable, "-c", "import sys, anyio; from agentloop.engine.local.process import LocalEngineProcess; "
                "p = LocalEngineProcess(sys.argv[1]); url = anyio.run(p.start); open(sys.argv[2], 'w').write(url); "
                "import time; time.sleep(3600)", str(model), str(ready)]
    else:
        argv = [sys.executable, "-m", "agentloop.engine.launch", "--model-path", str(model), "--mem-fraction",
                str(args.mem_fraction), "--ready-file", str(ready), "--log", str(work / "launcher_server.log")]
    launcher = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env())
    deadline = time.monotonic() + args.start_timeout
    while not ready.exists() and launcher.poll() is None and time.monotonic() < deadline:
        await anyio.sleep(0.5)
    servers = _children(launcher.pid)
    group = sorted({p for s in servers for p in _group_pids(s)})
    used_up = gpu_used_gib()
    res.stage("launcher_sigkilled", ready=ready.exists(), server_pids=group, gpu_used_gib_before=used_before,
              gpu_used_gib_up=used_up)
    launcher.kill()
    launcher.wait()
    t0 = time.monotonic()
    while any(_group_pids(s) for s in servers) and time.monotonic() - t0 < 60:
        await anyio.sleep(0.1)
    gone_after = round(time.monotonic() - t0, 2)
    left = sorted({p for s in servers for p in _group_pids(s)})
    while used_before is not None and (gpu_used_gib() or 0) > used_before + 1.0 and time.monotonic() - t0 < 60:
        await anyio.sleep(0.2)
    res.stage("launcher_sigkilled", processes_left=left, gone_after_seconds=gone_after,
              gpu_used_gib_after=gpu_used_gib(), freed_after_seconds=round(time.monotonic() - t0, 2))
    for p in left:  # only if the check fails: leave nothing behind
        os.kill(p, signal.SIGKILL)
    res.check("launcher_sigkill_takes_the_server_tree", bool(group) and len(group) >= (1 if args.dry_run else 3) and not left)
    if used_before is not None:
        res.check("launcher_sigkill_frees_the_gpu", (gpu_used_gib() or 0) <= used_before + 1.0)


async def two_servers_one_killed(res: Results, model: Path, args: argparse.Namespace, work: Path) -> None:
    from agentloop.runtime import Runtime

    servers = [Server(model, args.dry_run, args.mem_fraction), Server(model, args.dry_run, args.mem_fraction)]
    urls = ["", ""]

    async def start(i: int) -> None:
        urls[i] = await servers[i].start(args.start_timeout)

    for i in range(2):  # one after another: SGLang sizes its KV pool from the memory free at its own start
        await start(i)
    res.stage("two_servers_one_killed", urls=urls, gpu_used_gib_both_up=gpu_used_gib())
    cfg = {"engine": {"urls": urls, "tokenizer": str(model), "liveness_timeout": 5.0},
           "scheduler": {"n": 2, "concurrency": 64}, "agent": {"sampling": {"temperature": 0.0}}}
    from agentloop.data import arithmetic_prompts

    rows = [json.loads(x) for x in arithmetic_prompts().read_text().splitlines() if x.strip()]

    def samples(step: int) -> list[dict[str, Any]]:  # dataset rows, as the CLI reads them
        return [dict(r, uid=f"s{step}-{i}") for i, r in enumerate(rows[16 * step:16 * step + 16])]

    def step_record(r: Any) -> dict[str, Any]:
        m = r.metrics
        return {"status_counts": m["status_counts"], "trajectories": len(r.trajectories), "carried_over": len(r.carry_over),
                "servers_used": sorted({u for t in r.trajectories for u in t.extra.get("servers", [])}),
                "servers_removed": m.get("servers_removed"), "servers_readmitted": m.get("servers_readmitted"),
                "servers_out_of_rotation": m.get("servers_out_of_rotation"), "stage_seconds": m.get("stage_seconds"),
                "generations_outside_awake": m.get("generations_outside_awake")}

    try:
        async with Runtime(cfg) as rt:
            r1 = await rt.step(samples(1))
            res.stage("two_servers_one_killed", step1=step_record(r1))
            servers[1].kill()
            await anyio.sleep(1.0)
            res.stage("two_servers_one_killed", killed=urls[1], killed_alive=servers[1].alive())
            r2 = await rt.step(samples(2))
            res.stage("two_servers_one_killed", step2=step_record(r2))
            res.check("step_after_kill_completes_on_the_other", len(r2.trajectories) == 32
                      and r2.metrics["status_counts"]["failed"] == 0 and step_record(r2)["servers_used"] == [urls[0]]
                      and urls[1] in (r2.metrics.get("servers_removed") or {}))
            servers[1] = Server(model, args.dry_run, args.mem_fraction, port=servers[1].port)
            await servers[1].start(args.start_timeout)
            r3 = await rt.step(samples(3))
            res.stage("two_servers_one_killed", step3=step_record(r3), gpu_used_gib_after_step3=gpu_used_gib())
            res.check("restarted_server_readmitted", r3.metrics.get("servers_readmitted") == [urls[1]]
                      and step_record(r3)["servers_used"] == sorted(urls) and r3.metrics["status_counts"]["failed"] == 0)
            res.check("no_generation_outside_awake", rt.lifecycle.generations_outside_awake == 0)
        states = [await server_state(u) for u in urls]
        res.stage("two_servers_one_killed", servers_after_stop=states)
        res.check("both_servers_alive_and_awake_after_stop", all(s["alive"] and s["weight_version"] == "default" for s in states))
    finally:
        for s in servers:
            with anyio.CancelScope(shield=True):
                res.stage("two_servers_one_killed", **{f"log_tail_{s.port}": s.log_tail()})
                await s.stop()


async def main(args: argparse.Namespace) -> int:
    from agentloop.models import tiny_tool_model

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = Results(out_dir, args.dry_run)
    work = Path(tempfile.mkdtemp(prefix="gpu_faults_"))
    model = tiny_tool_model()
    server = Server(model, args.dry_run, args.mem_fraction)
    stages = set(args.stages.split(","))
    try:
        if stages & {"consecutive_runs", "sigkill_mid_step", "second_attach"}:
            t0 = time.monotonic()
            url = await server.start(args.start_timeout)
            res.stage("server", url=url, start_seconds=round(time.monotonic() - t0, 1), gpu_used_gib=gpu_used_gib())
            if "consecutive_runs" in stages:
                await consecutive_runs(res, url, work, args.runs)
            if "sigkill_mid_step" in stages:
                await sigkill_mid_step(res, url, work)
            if "second_attach" in stages:
                await second_attach(res, url, model, work)
            res.check("first_server_never_crashed", server.alive())
            res.stage("server", log_tail=server.log_tail())
            await server.stop()
        if "two_servers_one_killed" in stages:
            await two_servers_one_killed(res, model, args, work)
        if "launcher_sigkilled" in stages:
            await launcher_sigkilled(res, model, args, work)
    except Exception:
        res.stage("error", traceback=traceback.format_exc())
        res.check("no_error", False)
    finally:
        with anyio.CancelScope(shield=True):
            await server.stop()
    res.doc["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    res.save()
    failed = [k for k, v in res.doc["checks"].items() if not v]
    print(json.dumps({"checks": res.doc["checks"], "failed": failed, "results": str(res.path)}, indent=1))
    return 1 if failed else 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="where gpu_engine_faults.json goes")
    p.add_argument("--dry-run", action="store_true", help="the CPU engine stands in for SGLang (to debug this script)")
    p.add_argument("--runs", type=int, default=3, help="consecutive rollout runs against one server")
    p.add_argument("--mem-fraction", type=float, default=0.3, help="--mem-fraction-static of each SGLang server")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to come up")
    p.add_argument("--stages", default="consecutive_runs,sigkill_mid_step,two_servers_one_killed,second_attach,"
                   "launcher_sigkilled",
                   help="comma-separated stages to run (e.g. two_servers_one_killed alone, to fit a time limit)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(anyio.run(main, parse()))
