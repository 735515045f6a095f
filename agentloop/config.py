"""Validated settings of the runtime: engines, scheduling, agent loops (pydantic models).

This module owns the *shape* of the configuration only: `RuntimeConfig` = `EngineConfig` (which
engines: the embedded CPU engine, URLs of running SGLang servers, or SGLang servers to launch;
staged or one-stage wake-up; memory tags) + `SchedulerConfig` (concurrency, GRPO group size,
timeouts, over-sampling, partial rollout) + `AgentSettings` (mirrors `agentloop.agents.AgentConfig`)
+ `RayConfig` (Ray mode: cluster address, worker actors, engine placement; used by
`agentloop.distributed.RayRuntime`, and by `agentloop rollout` when `ray.enabled`).
Every field carries a description so the CLI can print documented defaults and embed
`RuntimeConfig` in its YAML file; unknown keys are rejected (a typo must not be silently ignored).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .agents.base import AgentConfig
from .engine.base import MEMORY_TAGS, SamplingParams

__all__ = ["AgentSettings", "EngineConfig", "LaunchConfig", "RayConfig", "RuntimeConfig", "SchedulerConfig"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LaunchConfig(_Strict):
    """SGLang servers the runtime starts itself (through `agentloop.engine.launch`)."""

    model_path: str = Field(description="Local model folder passed to `sglang.launch_server --model-path`.")
    num_servers: int = Field(1, ge=1, description="How many servers to launch (one per GPU).")
    gpu_ids: list[int] | None = Field(None, description="GPU index for each server (default 0..num_servers-1).")
    mem_fraction_static: float | None = Field(None, gt=0, le=1, description="`--mem-fraction-static` for each server.")
    flags: list[str] = Field(default_factory=list, description="Extra command-line flags passed to every server verbatim.")


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
    local_args: list[str] = Field(
        default_factory=list, description="Extra arguments for each embedded `agentloop serve` process."
    )
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
    request_timeout: float = Field(600.0, gt=0, description="Seconds one generate request may take.")
    start_timeout: float = Field(180.0, gt=0, description="Seconds to wait for engine servers to come up.")
    settle_timeout: float = Field(60.0, gt=0, description="Seconds sleep waits for aborted requests to settle.")
    stage_timeout: float = Field(600.0, gt=0, description="Seconds one lifecycle stage may take on one server.")

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


class SchedulerConfig(_Strict):
    """How one step's trajectories are run: limits, GRPO groups, timeouts, over-sampling."""

    concurrency: int = Field(64, ge=1, description="Most trajectories in flight at once (all servers together).")
    per_server_concurrency: int | None = Field(
        None, ge=1, description="Most generate requests in flight on one server (None: no per-server limit)."
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
        1.0, ge=1.0, description="Prompts to draw per step = ceil(target_groups * oversample_factor) (used by feeders)."
    )
    partial_rollout: bool = Field(
        True,
        description="Carry aborted trajectories over and continue them next step (True), or restart their prompts "
        "from scratch (False).",
    )
    max_turn_retries: int = Field(
        3, ge=0, description="How often one model turn is retried on another server when its server fails."
    )
    server_failure_threshold: int = Field(
        2, ge=1, description="Consecutive failed requests after which a server is taken out of the rotation."
    )

    def prompts_per_step(self, default: int) -> int:
        """How many prompts a feeder should draw: `default`, or the over-sampled count if `target_groups` is set."""
        if self.target_groups is None:
            return default
        import math

        return math.ceil(self.target_groups * self.oversample_factor)


class AgentSettings(_Strict):
    """Mirror of `agentloop.agents.AgentConfig` (per-run knobs every agent loop understands)."""

    agent: str | None = Field("tool", description="Agent loop (registry name) for samples that name none (None: 'tool').")
    tools: str | None = Field(None, description="Tool YAML config file. None: the built-in tools.")
    max_assistant_turns: int = Field(8, ge=1, description="Most model turns in one trajectory.")
    max_user_turns: int = Field(4, ge=0, description="Most simulated-user turns in one trajectory.")
    max_response_tokens: int = Field(1024, ge=1, description="Token budget of the whole response (all turns, tool tokens included).")
    max_context_tokens: int = Field(4096, ge=1, description="Prompt + response may not exceed this (the engine's context).")
    max_new_tokens_per_turn: int = Field(256, ge=1, description="Most tokens one model turn may generate.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(-1, description="Top-k sampling (-1: off).")
    min_p: float = Field(0.0, ge=0, le=1, description="Min-p sampling threshold.")
    seed: int | None = Field(
        None,
        description="Sampling seed (None: unseeded). Each model turn of each sample is sent a seed derived from it, "
        "the sample's uid, its index in the group and the turn: the samples of a group stay distinct and a re-run "
        "with the same seed repeats exactly.",
    )
    tool_parser: str = Field("hermes", description="Tool-call parser name (see `agentloop.tools.parsers`).")
    tool_timeout: float = Field(30.0, gt=0, description="Seconds one tool call may take.")
    max_parallel_calls: int = Field(4, ge=1, description="Tool calls of one turn run concurrently up to this many.")
    max_tool_response_tokens: int = Field(256, ge=1, description="Tool results are truncated to this many tokens.")
    tool_response_truncate_side: Literal["left", "right", "middle"] = Field(
        "middle", description="Which part of a long tool result is cut."
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Free settings passed to agent loops in `AgentConfig.extra`.")

    def to_agent_config(self) -> AgentConfig:
        return AgentConfig(
            max_assistant_turns=self.max_assistant_turns,
            max_user_turns=self.max_user_turns,
            max_response_tokens=self.max_response_tokens,
            max_context_tokens=self.max_context_tokens,
            max_new_tokens_per_turn=self.max_new_tokens_per_turn,
            sampling=SamplingParams(
                max_new_tokens=self.max_new_tokens_per_turn,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                sampling_seed=self.seed,
            ),
            tool_parser=self.tool_parser,
            tool_timeout=self.tool_timeout,
            max_parallel_calls=self.max_parallel_calls,
            max_tool_response_tokens=self.max_tool_response_tokens,
            tool_response_truncate_side=self.tool_response_truncate_side,
            extra=dict(self.extra),
        )


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
    max_worker_replacements: int = Field(4, ge=0, description="Dead workers replaced by fresh actors, at most this many.")
    max_worker_attempts: int = Field(3, ge=1, description="Workers one trajectory may be tried on before it fails.")
    liveness_timeout: float = Field(
        5.0, gt=0, description="Seconds a server has to answer the liveness probe before each wake-up and sleep."
    )


class RuntimeConfig(_Strict):
    """Everything `agentloop.runtime.Runtime` needs."""

    engine: EngineConfig = Field(default_factory=EngineConfig, description="Engine servers and their lifecycle.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="How a step's trajectories run.")
    agent: AgentSettings = Field(default_factory=AgentSettings, description="Agent-loop settings.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray mode (agentloop.distributed.RayRuntime): cluster, "
                           "workers, engine placement. Off unless `enabled` (or a RayRuntime is built).")
