"""`scheduler.concurrency: auto`: how many trajectories a step runs at once, from what the engines can run.

A default made for the CPU engine (a few dozen requests per batch) throttles SGLang on a GPU, which runs
hundreds to thousands of requests in one batch; a number nobody chose should come from the server. The
rule, applied once when the runtime has its engines (`resolve_concurrency`):

- Every server is the embedded CPU engine (its `/server_info` says `engine: agentloop-cpu`): the CPU
  default, `CPU_ENGINE_CONCURRENCY` (64, the library's measured default before `auto`).
- Otherwise the sum over servers of what each one admits at once (`server_capacity`), read from
  SGLang's `/server_info` (0.5.x, `http_server.get_server_info` = the server args + the scheduler's
  init info + one `internal_states` entry per data-parallel rank, from `Scheduler.get_internal_state`):
  the sum of `internal_states[*].effective_max_running_requests_per_dp` (the scheduler's running-batch
  cap after SGLang derived it from the KV pool, `max_total_num_tokens`, and `--max-running-requests`);
  without it, the `max_running_requests` server arg (null unless given at launch) times `dp_size`.
  A server that reports neither (or cannot be asked) counts as `CPU_ENGINE_CONCURRENCY`, and says so.

`max_total_num_tokens` (the KV pool's size in tokens) is reported alongside: SGLang already caps its
running batch by it, so it is not applied twice; a step whose trajectories outgrow the pool makes
SGLang queue or retract requests, which the engine busy fraction of `summary.json` then shows.
An integer `concurrency` is used as given (the info says so). The CPU engine serves the same fields
the same way (`engine/local/server.py`), so the rule is tested without a GPU.

`scheduler.per_server_concurrency: auto` (opt-in; the default is no per-server limit) becomes the
servers' decode CUDA graph batch (`decode_graph_batch`): past it SGLang decodes without its graphs, and
with hundreds of trajectories in flight a limit there measured faster on an H100 (benchmarks/README.md,
"A per-server request limit"). Read from the server args in `/server_info`: sglang 0.5.17's resolved
`cuda_graph_config.decode.max_bs` (unless its backend is "disabled"), else `cuda_graph_max_bs_decode`,
else the older `cuda_graph_max_bs`; `disable_cuda_graph` means none. The router has one limit for every
server: the smallest reported; if no server reports one, no limit (and the rule says why).

`scheduler.server_priority: oldest_first` sends SGLang's request `priority` (higher = older). It is
checked against each server's args in `/server_info` (`check_server_priority`): a server that schedules
low values first (`schedule_low_priority_values_first`) would serve the youngest first, and one that
refuses priorities without priority scheduling (`abort_on_priority_when_disabled`) would abort every
request, so both are errors that name the server and the flag; a server that does not schedule by
priority only ignores them (a warning; the rule says so); one that reports none of these is trusted.
A SGLang server that preempts for priority (the default under --enable-priority-scheduling) is warned
about: on sglang 0.5.17 preempted requests came back with an output id that had no logprob
(benchmarks/results/long_tail_sglang_h200_priority_preemption_failed.json; the cause is
`engine.base.SGLANG_RETRACT_LOGPROB_BUG`). The client drops such an answer and asks for the turn again
(`RouterStats.misaligned_answers`), which costs the whole turn, so such servers should run with
--disable-priority-preemption (the queue is then ordered, nothing preempted).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import anyio

from ..config.settings import CPU_ENGINE_CONCURRENCY, RuntimeConfig
from ..engine.base import SGLANG_RETRACT_LOGPROB_BUG, EngineClient

log = logging.getLogger(__name__)

__all__ = ["CPU_ENGINE_CONCURRENCY", "ConcurrencyInfo", "check_server_priority", "decode_graph_batch", "resolve_concurrency",
           "server_capacity"]


@dataclass
class ConcurrencyInfo:
    """What `scheduler.concurrency` resolved to, and why (written to summary.json as is)."""

    setting: int | str  #: as configured: an integer or "auto"
    used: int  #: trajectories in flight at once, at most
    rule: str  #: one line: where `used` came from
    #: Generate requests all servers admit at once (None: unknown, e.g. a server that reports nothing).
    engine_capacity: int | None = None
    per_server: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: `scheduler.per_server_concurrency` as configured, what it resolved to (None: no limit), and why.
    per_server_setting: int | str | None = None
    per_server_used: int | None = None
    per_server_rule: str = "not set: no per-server limit"
    #: `scheduler.server_priority` and what the servers do with it.
    server_priority: str = "none"
    server_priority_rule: str = "none: no request priority sent"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else None


def server_capacity(info: Mapping[str, Any]) -> int | None:
    """Generate requests one server runs at once, from its `/server_info` (None: not reported)."""
    states = info.get("internal_states")
    if isinstance(states, list):
        per_rank = [_int(s.get("effective_max_running_requests_per_dp")) for s in states if isinstance(s, Mapping)]
        if per_rank and all(n is not None for n in per_rank):
            return sum(n for n in per_rank if n is not None)
    n = _int(info.get("max_running_requests"))
    if n is not None:
        return n * (_int(info.get("dp_size")) or 1)
    return None


def decode_graph_batch(info: Mapping[str, Any]) -> int | None:
    """The largest batch one server decodes inside its CUDA graphs, from its `/server_info` (None: no
    graphs, or not reported)."""
    if info.get("disable_cuda_graph") is True:
        return None
    graphs = info.get("cuda_graph_config")
    decode = graphs.get("decode") if isinstance(graphs, Mapping) else None
    if isinstance(decode, Mapping):
        if str(decode.get("backend", "")).lower() == "disabled":
            return None
        n = _int(decode.get("max_bs"))
        if n is not None:
            return n
    return _int(info.get("cuda_graph_max_bs_decode")) or _int(info.get("cuda_graph_max_bs"))


def is_cpu_engine(info: Mapping[str, Any]) -> bool:
    return info.get("engine") == "agentloop-cpu"


async def _server_info(client: EngineClient, timeout: float) -> Mapping[str, Any] | None:
    try:
        with anyio.fail_after(timeout):
            return await client.server_info()
    except Exception as e:  # informational: the fallback is said, not fatal
        log.warning("cannot read /server_info of %s (%s): it counts as %d for concurrency: auto",
                    getattr(client, "url", client), e, CPU_ENGINE_CONCURRENCY)
        return None


async def resolve_concurrency(config: RuntimeConfig, clients: Sequence[EngineClient],
                              timeout: float = 30.0) -> tuple[RuntimeConfig, ConcurrencyInfo]:
    """The config with `scheduler.concurrency` an integer (a copy when it was `auto`), and why."""
    setting = config.scheduler.concurrency
    infos = [await _server_info(c, timeout) for c in clients]
    per_server: dict[str, dict[str, Any]] = {}
    caps: list[int | None] = []
    for c, info in zip(clients, infos):
        cap = server_capacity(info) if info is not None else None
        caps.append(cap)
        per_server[str(getattr(c, "url", c))] = {
            "engine": "cpu" if info is not None and is_cpu_engine(info) else ("sglang" if info is not None else "unknown"),
            "max_running_requests": cap,
            "max_total_num_tokens": _int(info.get("max_total_num_tokens")) if info is not None else None,
        }
    capacity = sum(c for c in caps if c is not None) if caps and all(c is not None for c in caps) else None
    config, per_server_limit = _resolve_per_server(config, infos, per_server)
    per_server_limit.update(check_server_priority(config.scheduler.server_priority, infos, list(per_server)))
    if isinstance(setting, int):
        return config, ConcurrencyInfo(setting, setting, "set in the configuration", capacity, per_server, **per_server_limit)
    if infos and all(i is not None and is_cpu_engine(i) for i in infos):
        used, rule = CPU_ENGINE_CONCURRENCY, f"auto: the CPU engine's default ({CPU_ENGINE_CONCURRENCY})"
    else:
        unknown = [u for u, cap in zip(per_server, caps) if cap is None]
        used = sum(cap if cap is not None else CPU_ENGINE_CONCURRENCY for cap in caps) or CPU_ENGINE_CONCURRENCY
        rule = "auto: the sum of the servers' max running requests (/server_info)"
        if unknown:
            rule += f"; {', '.join(unknown)} reported none and count as {CPU_ENGINE_CONCURRENCY}"
            log.warning("concurrency auto: %s report no max running requests; each counts as %d",
                        ", ".join(unknown), CPU_ENGINE_CONCURRENCY)
    scheduler = config.scheduler.model_copy(update={"concurrency": used})
    return (config.model_copy(update={"scheduler": scheduler}),
            ConcurrencyInfo(setting, used, rule, capacity, per_server, **per_server_limit))


def check_server_priority(setting: str, infos: Sequence[Mapping[str, Any] | None],
                          urls: Sequence[str]) -> dict[str, str]:
    """`scheduler.server_priority` against the servers' args: the ConcurrencyInfo fields, or ValueError
    for a server that would invert the order or abort the requests."""
    if setting == "none":
        return {"server_priority": setting, "server_priority_rule": "none: no request priority sent"}
    ignoring: list[str] = []
    preempting: list[str] = []
    for url, info in zip(urls, infos):
        if info is None:
            continue
        if info.get("enable_priority_scheduling") is True:
            if info.get("disable_priority_preemption") is False and not is_cpu_engine(info):
                preempting.append(url)
            if info.get("schedule_low_priority_values_first") is True:
                raise ValueError(
                    f"scheduler.server_priority {setting}: {url} runs with --schedule-low-priority-values-first, so "
                    "it would serve the youngest trajectories first; launch it without that flag (agentloop sends "
                    "higher priorities for older trajectories) or set server_priority: none")
        elif info.get("enable_priority_scheduling") is False:
            if info.get("abort_on_priority_when_disabled") is True:
                raise ValueError(
                    f"scheduler.server_priority {setting}: {url} runs without --enable-priority-scheduling and with "
                    "--abort-on-priority-when-disabled, so it would abort every request; launch it with "
                    "--enable-priority-scheduling or set server_priority: none")
            ignoring.append(url)
    rule = f"{setting}: SGLang request priority = minus the trajectory's age (older first)"
    if ignoring:
        rule += f"; {', '.join(ignoring)} run without --enable-priority-scheduling and ignore it"
        log.warning("server_priority %s: %s run without --enable-priority-scheduling: the priorities are ignored there",
                    setting, ", ".join(ignoring))
    if preempting:
        why = (f"{SGLANG_RETRACT_LOGPROB_BUG}: the client drops such an answer and asks for the turn again, at the cost "
               "of the whole turn; launch with --disable-priority-preemption")
        rule += f"; {', '.join(preempting)} preempt running requests ({why})"
        log.warning("server_priority %s: %s run SGLang's priority preemption (seen on sglang 0.5.17: benchmarks/results/"
                    "long_tail_sglang_h200_priority_preemption_failed.json); %s", setting, ", ".join(preempting), why)
    return {"server_priority": setting, "server_priority_rule": rule}


def _resolve_per_server(config: RuntimeConfig, infos: Sequence[Mapping[str, Any] | None],
                        per_server: dict[str, dict[str, Any]]) -> tuple[RuntimeConfig, dict[str, Any]]:
    """`scheduler.per_server_concurrency` made an integer (or None) when it is `auto`, and why."""
    setting = config.scheduler.per_server_concurrency
    if setting != "auto":
        rule = "set in the configuration" if setting is not None else "not set: no per-server limit"
        return config, {"per_server_setting": setting, "per_server_used": setting, "per_server_rule": rule}
    graphs = [decode_graph_batch(i) if i is not None else None for i in infos]
    known = [n for n in graphs if n is not None]
    used = min(known) if known else None
    if used is None:
        rule = "auto: no server reports a decode CUDA graph batch (/server_info): no per-server limit"
        log.warning("per_server_concurrency auto: %s; set a number to limit the requests per server", rule[6:])
    else:
        silent = [u for u, n in zip(per_server, graphs) if n is None]
        rule = "auto: the servers' decode CUDA graph batch (/server_info)" + (
            f"; {', '.join(silent)} reported none" if silent else "")
    scheduler = config.scheduler.model_copy(update={"per_server_concurrency": used})
    return (config.model_copy(update={"scheduler": scheduler}),
            {"per_server_setting": setting, "per_server_used": used, "per_server_rule": rule})
