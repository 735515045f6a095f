"""Validated settings of the runtime: engines, scheduling, agent loops (pydantic models).

This module owns the *shape* of the configuration only: `RuntimeConfig` = `EngineConfig` (which
engines: the embedded CPU engine, URLs of running SGLang servers, or SGLang servers to launch;
staged or one-stage wake-up; memory tags) + `SchedulerConfig` (`config/scheduler.py`: concurrency, GRPO group size,
timeouts, over-sampling, partial rollout, request slots) + `agentloop.agents.AgentConfig` (the agent loops' own
model, used here as is: turn limits, sampling, tools) + `RayConfig` (Ray mode: cluster address, worker actors, engine placement; used by
`agentloop.distributed.RayRuntime`, and by `agentloop rollout` when `ray.enabled`).
Every field carries a description so the CLI can print documented defaults and embed
`RuntimeConfig` in its YAML file; unknown keys are rejected (a typo must not be silently ignored).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ..agents.base import AgentConfig, SamplingConfig
from ..engine.base import MEMORY_TAGS, engine_url
from .scheduler import CPU_ENGINE_CONCURRENCY, SchedulerConfig
from .strict import Strict as _Strict

# SchedulerConfig and CPU_ENGINE_CONCURRENCY live in `.scheduler`; imported here for RuntimeConfig and the
# callers that take every section from this module.
__all__ = ["AgentConfig", "CPU_ENGINE_CONCURRENCY", "EngineConfig", "LaunchConfig", "RayConfig", "RuntimeConfig", "SamplingConfig", "SchedulerConfig"]


class LaunchConfig(_Strict):
    """SGLang servers the runtime starts itself (through `agentloop.engine.launch`)."""

    model_path: str = Field(description="Local model folder passed to `sglang.launch_server --model-path`.")
    num_servers: int = Field(1, ge=1, description="How many servers to launch (one per GPU).")
    gpu_ids: list[int] | None = Field(None, description="GPU index for each server (default 0..num_servers-1).")
    mem_fraction_static: float | None = Field(None, gt=0, le=1, description="`--mem-fraction-static` for each server.")
    flags: list[str] = Field(default_factory=list, description="Extra command-line flags passed to every server verbatim.")


class LocalServerConfig(_Strict):
    """Settings of each embedded CPU engine server (`agentloop serve`); unset: that command's default."""

    num_threads: int | None = Field(
        None, ge=0, description="torch CPU threads of each engine (serve's default 1: fastest for small models, "
        "measured in benchmarks/serve_threads.py; 0: torch's choice, one per core).")
    context_length: int | None = Field(
        None, ge=1, description="Usable context of each engine (serve's default: the model's max_position_embeddings).")
    max_running_requests: int | None = Field(None, ge=1, description="Requests batched at once (serve's default 64).")
    max_prefill_tokens: int | None = Field(
        None, ge=1, description="Padded tokens of one batched prefill forward (serve's default 8192).")
    seed: int | None = Field(None, description="Seed of requests that carry no sampling_seed (serve's default 0).")
    return_original_logprob: bool = Field(
        False, description="Report log_softmax(logits) instead of SGLang's default temperature-scaled logprobs.")
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = Field(
        None, description="Log level of each engine process (serve's default info).")
    enable_priority_scheduling: bool = Field(
        False, description="Admit queued requests by their priority and preempt lower-priority running ones when "
        "the batch is full, as SGLang's --enable-priority-scheduling (with scheduler.server_priority).")

    def serve_args(self) -> list[str]:
        """These settings as `agentloop serve` flags (only the ones set)."""
        args: list[str] = []
        for name, value in self.model_dump().items():
            if value is None or value is False:
                continue
            flag = "--" + name.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        return args


class EngineConfig(_Strict):
    """Which engine servers serve the policy, and how their memory lifecycle runs."""

    urls: list[str] = Field(
        default_factory=list,
        description="URLs of running SGLang(-compatible) servers to attach to. Empty: use the embedded CPU engine "
        "(or `launch`).",
    )
    model: str | None = Field(
        None,
        description="Model folder for the embedded CPU engine. Default: the shipped tiny tool-calling model.",
    )
    num_local_servers: int = Field(1, ge=1, description="How many embedded CPU engine servers to start.")
    local: LocalServerConfig = Field(
        default_factory=LocalServerConfig, description="Settings of each embedded CPU engine server.")
    launch: LaunchConfig | None = Field(None, description="Launch SGLang servers instead of using `urls` or the CPU engine.")
    tokenizer: str | None = Field(
        None,
        description="Tokenizer folder. Default: the model folder (embedded/launched), else the servers' "
        "`model_info()['tokenizer_path']`.",
    )
    staged: bool = Field(
        True,
        description="Staged wake-up (resume weights → load weights → resume KV cache/CUDA graphs). False: one-stage "
        "resume of every tag, for engines without memory tags.",
    )
    release_tags: list[Literal["weights", "kv_cache", "cuda_graph"]] = Field(
        default_factory=lambda: list(MEMORY_TAGS),
        description="Memory tags released at sleep (and resumed at wake-up).",
    )
    request_timeout: float = Field(
        300.0, gt=0,
        description="Seconds one generate request may take before it is retried on another server. Keep it well "
        "under scheduler.trajectory_timeout, so a request stuck on a bad server leaves time to fail over.",
    )
    hung_timeout: float | None = Field(
        60.0, gt=0,
        description="Step watchdog: a server that has generate requests in flight, answers none of them for this many "
        "seconds and does not answer a `/model_info` probe either is hung (a stopped or wedged process); it is taken "
        "out of rotation and its requests are retried on the other servers, well inside scheduler.trajectory_timeout. "
        "A server whose HTTP still answers is only slow: its requests keep request_timeout. None: no watchdog.",
    )
    liveness_timeout: float = Field(
        5.0, gt=0,
        description="Seconds a server has to answer the liveness probe (`/model_info`, safe in any memory state) "
        "before each wake-up and sleep. A server that does not is taken out of the step; one out of rotation that "
        "answers again is re-admitted in its real memory state and gets the step's weights.",
    )
    attach_state: Literal["auto", "awake", "asleep"] | list[Literal["weights", "kv_cache", "cuda_graph"]] = Field(
        "auto",
        description="Memory state of the servers when the runtime attaches. auto: read the state the last runtime "
        "recorded in each server's weight version (none recorded: awake, as a fresh server). awake (nothing released), "
        "asleep (every tag released) or the list of released tags: say it yourself, for a server whose state is "
        "unknown (a runtime killed during a release or resume call leaves that; the next run names the value to set).",
    )
    takeover: bool = Field(
        False,
        description="Attach even to servers another runtime drives now (its lease, recorded in each server's weight "
        "version, names it). Only for a runtime you know is dead on another machine: a dead one on this machine is "
        "taken over without it, and one elsewhere once its lease expires (engine.lease_timeout).",
    )
    lease_timeout: float = Field(
        600.0, gt=0,
        description="Seconds this runtime's lease on its servers lasts unless renewed (it is renewed at every "
        "wake-up and sleep and during rollouts, not between steps). Another runtime on this machine checks the "
        "owner's process instead; one on another machine waits for the lease to expire before it takes the server "
        "over, so keep it above the time between your steps if runtimes on several machines share servers.",
    )
    restore_on_stop: bool = Field(
        True,
        description="When the runtime stops, leave servers attached by URL as they were before any runtime touched them: "
        "awake (woken again with the weights of their model path, under the weight version they had), or asleep if a "
        "runtime had parked them. False: park them (leave them asleep, memory released, marked as asleep on purpose), "
        "e.g. for a trainer that keeps the GPU afterwards; the next runtime leaves them parked too.",
    )
    keepalive_timeout: float = Field(
        2.0, gt=0,
        description="Seconds an idle HTTP connection to an engine server is kept for reuse. Must stay below the "
        "server's keep-alive (SGLang/uvicorn: 5 s, SGLANG_TIMEOUT_KEEP_ALIVE), or a request can be written onto a "
        "connection the server is closing (requests that provably never reached the server are sent again).",
    )
    check_finite_weights: bool = Field(
        True,
        description="Refuse a tensor weight update holding NaN or Inf (naming the tensor) before it is sent: an engine "
        "takes such weights and then fails every sampled generate. Costs one sum per tensor: 2.8 s per GB of float32 "
        "on 2 busy CPU cores (benchmarks/results/weight_finite_check_cpu.json); on a GPU it runs on the device.",
    )
    start_timeout: float = Field(
        600.0, gt=0,
        description="Seconds to wait for engine servers to come up (a server that exits is reported at once). A "
        "launched SGLang's cold start on an H200 took 60-85 s plus ~80 s of JIT compile; the CPU engine starts in seconds.",
    )
    settle_timeout: float = Field(60.0, gt=0, description="Seconds sleep waits for aborted requests to settle.")
    stage_timeout: float = Field(600.0, gt=0, description="Seconds one lifecycle stage may take on one server.")

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        return [engine_url(u) for u in urls]  # `127.0.0.1:30000` is accepted as http://127.0.0.1:30000

    @model_validator(mode="after")
    def _one_source(self) -> "EngineConfig":
        if self.urls and self.launch is not None:
            raise ValueError("engine: give either `urls` (running servers) or `launch` (servers to start), not both")
        return self

    @property
    def mode(self) -> Literal["urls", "launch", "embedded"]:
        if self.urls:
            return "urls"
        if self.launch is not None:
            return "launch"
        return "embedded"


class RayConfig(_Strict):
    """Ray mode: where `agentloop.distributed.RayRuntime` runs its workers and engines (docs/distributed.md).

    Only the shape lives here (no Ray import): the rest of the settings are the ordinary ones."""

    enabled: bool = Field(
        False,
        description="Run on Ray: `agentloop rollout` builds a `RayRuntime` (agent-loop workers and engine servers as "
        "Ray actors) instead of the local `Runtime`. A trainer picks Ray mode by constructing "
        "`agentloop.distributed.RayRuntime`, which uses the rest of this section whatever `enabled` says.",
    )
    address: str | None = Field(
        None,
        description="`ray.init(address=...)`: None starts a local Ray (or joins RAY_ADDRESS), 'auto' joins the cluster "
        "this machine belongs to (`ray start` ran here), 'ray://head:10001' connects from outside (Ray Client). "
        "If the process already called `ray.init`, that session is used. The --ray-address flag also turns "
        "`enabled` on; in a file, set `enabled` too.",
    )
    init_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="More `ray.init` arguments, e.g. {num_cpus: 2, include_dashboard: false} for a local Ray "
        "(resources cannot be given when joining a running cluster).",
    )
    num_workers: int = Field(2, ge=1, description="Agent-loop worker actors (each runs many trajectories at once).")
    worker_capacity: int | None = Field(
        None, ge=1, description="Trajectories one worker runs at once (None: ceil(scheduler.concurrency / num_workers))."
    )
    worker_num_cpus: float = Field(0.0, ge=0, description="CPUs Ray reserves per worker (agent loops mostly wait on HTTP).")
    engine_num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per engine server actor.")
    engine_num_gpus: float = Field(
        1.0, ge=0, description="GPUs per launched SGLang server (engine.launch); 0.5: two servers share a GPU."
    )
    engine_host: str = Field(
        "127.0.0.1",
        description="Address engine servers bind: 127.0.0.1 (driver, workers and engines on one machine) or 'node' "
        "(the node's cluster IP, for workers on other machines; keep the cluster network private).",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Placement group strategy for launched GPU servers (PACK: fill a node first; SPREAD: "
        "different nodes)."
    )
    placement_timeout: float = Field(
        300.0, gt=0, description="Seconds to wait for Ray to place the engine server actors (and their placement "
        "group) before the start fails, naming the resources no node had free."
    )
    max_worker_replacements: int = Field(4, ge=0, description="Dead workers replaced by fresh actors, at most this many.")
    max_worker_attempts: int = Field(3, ge=1, description="Workers one trajectory may be tried on before it fails.")


class RuntimeConfig(_Strict):
    """Everything `agentloop.runtime.Runtime` needs."""

    engine: EngineConfig = Field(default_factory=EngineConfig, description="Engine servers and their lifecycle.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="How a step's trajectories run.")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="Agent-loop settings (agentloop.agents.AgentConfig).")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray mode (agentloop.distributed.RayRuntime): cluster, "
                           "workers, engine placement. Off unless `enabled` (or a RayRuntime is built).")
