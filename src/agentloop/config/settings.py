"""Validated settings of the runtime: engines, scheduling, agent loops (pydantic models).

This module owns the *shape* of the configuration only: `RuntimeConfig` = `EngineConfig` (which
engines: the embedded CPU engine, URLs of running SGLang servers, or SGLang servers to launch;
staged or one-stage wake-up; memory tags) + `SchedulerConfig` (concurrency, GRPO group size,
timeouts, over-sampling, partial rollout) + `agentloop.agents.AgentConfig` (the agent loops' own
model, used here as is: turn limits, sampling, tools) + `RayConfig` (Ray mode: cluster address, worker actors, engine placement; used by
`agentloop.distributed.RayRuntime`, and by `agentloop rollout` when `ray.enabled`).
Every field carries a description so the CLI can print documented defaults and embed
`RuntimeConfig` in its YAML file; unknown keys are rejected (a typo must not be silently ignored).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..agents.base import AgentConfig, SamplingConfig
from ..engine.base import MEMORY_TAGS, engine_url
from ..engine.route_session import ServerPriority, SlotOrder

__all__ = ["AgentConfig", "EngineConfig", "LaunchConfig", "RayConfig", "RuntimeConfig", "SamplingConfig", "SchedulerConfig"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


#: `scheduler.concurrency: auto` on the embedded CPU engine, for a server that reports no capacity, and
#: in a Scheduler used without a Runtime (nothing resolved it): the library's measured default before auto.
CPU_ENGINE_CONCURRENCY = 64


class SchedulerConfig(_Strict):
    """How one step's trajectories are run: limits, GRPO groups, timeouts, over-sampling."""

    concurrency: int | Literal["auto"] = Field(
        "auto",
        description="Most trajectories in flight at once (all servers together). auto: what the engines can run, "
        "read when the runtime starts: on SGLang the sum of the servers' max running requests (/server_info "
        "internal_states[].effective_max_running_requests_per_dp), on the embedded CPU engine 64; see "
        "agentloop.runtime.concurrency. summary.json's `concurrency` says what was used and why.",
    )
    per_server_concurrency: int | Literal["auto"] | None = Field(
        None, description="Most generate requests in flight on one server (None: no per-server limit). auto: the "
        "servers' decode CUDA graph batch, read from /server_info when the runtime starts (the smallest over the "
        "servers; no limit if none reports one), so SGLang keeps decoding inside its graphs when many more "
        "trajectories are in flight; summary.json's `concurrency` says what was used and why. The limit is per "
        "router: per Ray worker in Ray mode.",
    )
    slot_order: SlotOrder = Field(
        "fifo",
        description="With per_server_concurrency, who gets a freed request slot first: fifo = arrival order; "
        "depth_first = the trajectory with the most model turns behind it (then the oldest). Measured on an H200 "
        "at 256 slots: depth_first 0.94x fifo's throughput. oldest_first = the trajectory that started first in the step "
        "(its samples' order: carried groups first), so with over-sampling the surplus only fills slots the older "
        "groups leave free. target_first = the groups that will meet target_groups first (the undecided groups with "
        "the fewest members left, then the oldest, as many as the target still wants), then the surplus; with "
        "slot_preemption a target group's turn that finds every slot taken aborts a surplus request, which "
        "continues its turn in place later (tokens and logprobs kept). Without target_groups every group is a "
        "target group (fewest members left first, no preemption). Ray workers rank only their own trajectories.",
    )
    slot_preemption: bool = Field(
        False, description="With slot_order target_first: a target group's turn may take a surplus request's slot "
        "(the surplus request is aborted and its turn continued in place later). No effect with other orders. Off "
        "by default: on SGLang (one H100) the aborts and re-prefills cost more than the wait they saved "
        "(benchmarks/results/long_tail_sglang_h100_target_first.json: 1.15x wait-all against 1.43x without).",
    )
    server_priority: ServerPriority = Field(
        "none",
        description="oldest_first: every generate request carries SGLang's `priority` (older trajectories higher), "
        "for servers launched with --enable-priority-scheduling (default direction, higher first) and a "
        "--max-running-requests below the trajectories in flight: the server then admits the oldest trajectories' "
        "turns first and preempts younger running requests for them (over-sampling's surplus only fills what the "
        "target groups leave idle). Checked against each server's /server_info when the runtime starts: a server "
        "that schedules low values first is refused; one without priority scheduling is warned about (it ignores "
        "the priorities, or refuses them with --abort-on-priority-when-disabled, which is an error). On sglang 0.5.17 "
        "launch with --disable-priority-preemption: its preemption returned output ids without logprobs (refused, so "
        "those turns failed; warned at start). Measured on an H100 without preemption: 1.18x wait-all's returned "
        "tokens/s against 1.16x for the server's arrival-order queue (long_tail_sglang_h100_priority_no_preempt.json). "
        "In Ray mode each worker numbers its own trajectories.",
    )
    n: int = Field(1, ge=1, description="Trajectories per prompt (a GRPO group shares the prompt's `group_id`).")
    trajectory_timeout: float | None = Field(
        600.0, gt=0, description="Wall-clock seconds one trajectory may run; past it it is stopped and marked failed."
    )
    abort_grace: float = Field(
        10.0, gt=0, description="Seconds a stopped trajectory gets to return its partial result before it is cancelled."
    )
    reward_timeout: float = Field(30.0, gt=0, description="Seconds one reward computation may take.")
    reward: str | None = Field(
        "arithmetic",
        description="Reward function (registered name, see `agentloop.rewards`) for samples that name none but "
        "carry a `ground_truth`; samples with neither are not scored. Default: the arithmetic task's grader. None: "
        "only samples naming a reward are scored. A trainer's `Runtime(reward_fn=...)` replaces both.",
    )
    target_groups: int | None = Field(
        None,
        ge=1,
        description="Over-sampling: stop the step once this many groups are complete; the unfinished ones are aborted "
        "and carried over. None: wait for every trajectory.",
    )
    oversample_factor: float = Field(
        1.0, ge=1.0, description="Over-sampling for whoever draws the prompts: a step launches ceil(target_groups * "
        "oversample_factor) groups. Read by `agentloop rollout` (and by a trainer's feeder through "
        "`SchedulerConfig.prompts_per_step`); `Runtime.step` runs exactly the samples it is given."
    )
    group_filter: str | None = Field(
        None,
        description="Group filter (registered name, see `agentloop.group_filters`; built-in: drop_zero_variance) "
        "applied to every complete group: a rejected group leaves the batch and, with target_groups, does not count "
        "toward it (the step samples more prompts from `more_samples` instead). None: every group is kept.",
    )
    group_budget: int | None = Field(
        None,
        ge=1,
        description="With target_groups and a group filter: most groups one step may sample (the given prompts "
        "plus those drawn from `more_samples`); reaching it ends the step short of target_groups, reported as "
        "budget_exhausted. None: until `more_samples` runs out.",
    )
    partial_rollout: bool = Field(
        True,
        description="Carry aborted trajectories over and continue them next step (True), or restart their prompts "
        "from scratch (False).",
    )
    active: int | None = Field(
        None,
        ge=1,
        description="Over-admission: keep this many trajectories in flight, drawing fresh prompts from the step's "
        "feeder (`more_samples`, an iterator or async iterator) as soon as one finishes, until target_groups groups "
        "are accepted (the rest are stopped and carried over) or the feeder runs out. None: run the given samples "
        "(drawing only while a group filter keeps the step short of target_groups).",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="Staleness bound of carried trajectories: one whose first token was sampled more than this many "
        "weight versions before the step's is not resumed but handled by stale_policy. None: no bound.",
    )
    stale_policy: Literal["restart", "drop"] = Field(
        "restart",
        description="A carried trajectory past max_staleness: restart = run its sample again from the prompt this "
        "step (its tokens are discarded); drop = its whole group leaves the step (ScheduleResult.dropped).",
    )
    max_turn_retries: int = Field(
        3, ge=0, description="How often one model turn is retried on another server when its server fails."
    )
    server_failure_threshold: int = Field(
        2, ge=1, description="Consecutive failed requests after which a server is taken out of the rotation."
    )
    gc_freeze: bool = Field(
        False,
        description="Freeze the garbage collector's view of the objects that exist when a step starts "
        "(gc.freeze) until it ends (gc.unfreeze), so the step's collections skip the trainer's heap: less client "
        "CPU per token in a process with a large heap. Process-wide while the step runs (cycles among older "
        "objects are collected after it); skipped if anything else has frozen objects. See agentloop.gc_scope.",
    )

    @field_validator("concurrency", "per_server_concurrency", mode="before")
    @classmethod
    def _int_or_auto(cls, v: Any, info: Any) -> Any:
        # One message for the union (pydantic would give one per member, under odd location names).
        if v == "auto" or (v is None and info.field_name == "per_server_concurrency"):
            return v
        if isinstance(v, bool) or not isinstance(v, (int, str)) or (isinstance(v, str) and not v.strip().isdigit()):
            raise ValueError("Input should be a valid integer or 'auto'")
        if int(v) < 1:
            raise ValueError("Input should be greater than or equal to 1 (or 'auto')")
        return int(v)

    @field_validator("group_filter")
    @classmethod
    def _known_group_filter(cls, v: str | None) -> str | None:
        if v is not None:
            from ..group_filters import get_group_filter

            get_group_filter(v)  # raises naming the registered filters
        return v

    def prompts_per_step(self, default: int) -> int:
        """How many prompts a feeder should draw: `default`, or the over-sampled count if `target_groups` is set."""
        if self.target_groups is None:
            return default
        import math

        return math.ceil(self.target_groups * self.oversample_factor)


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
