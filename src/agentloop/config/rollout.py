"""The settings of `agentloop rollout`: one pydantic model, loaded from YAML, overridden by flags.

`RolloutConfig` = what the command itself needs (data, output folder, steps, prompts per step,
bad-row policy, display) + the embedded `agentloop.config.RuntimeConfig` under `runtime:`.
The rollout's own defaults for the runtime (GRPO groups of 2, short turns so the CPU demo is fast)
are deep-merged under whatever the file gives, so setting one nested key keeps the others.

The file uses the nested layout only (`runtime: {scheduler: {n: 8}}`); a flag's name written at its
top level (`n: 8`, `concurrency: 64`, `ray: true`) is refused naming the field to write instead.

Errors are `ConfigError`s that name the field (dotted path) and where it came from: the file and
line:column of the offending YAML node (from yaml's node marks), or the command-line flag.
`defaults_yaml()` renders every field with its description as a commented YAML file
(`agentloop config --show`).
"""

from __future__ import annotations

import copy
import textwrap
import types
from pathlib import Path
from typing import Any, Literal, Mapping, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from .settings import RuntimeConfig
from .strict import Strict
from ..yaml_strict import mark_where
from ..yaml_strict import safe_load as strict_yaml_load

#: Runtime settings the rollout command uses unless the YAML file or a flag says otherwise (and
#: `agentloop config --show` marks as the command's, next to the library's default).
#: Small turns keep the default CPU run (16 prompts x 2, 2 steps) well under a minute on 2 cores.
#: (The embedded engine runs one torch thread: `agentloop serve`'s own default, `engine.local.num_threads`.)
#: Concurrency is the library's `auto` (what the engines can run: 64 on the CPU engine, the servers'
#: max running requests on SGLang): a fixed 32 here throttled SGLang on an H200 to waves of 32.
ROLLOUT_RUNTIME_DEFAULTS: dict[str, Any] = {
    "scheduler": {"n": 2},
    "agent": {
        "max_assistant_turns": 4,
        "max_new_tokens_per_turn": 64,
        "max_response_tokens": 384,
    },
}


#: `agentloop rollout` flag (dest, i.e. without `--`, dashes as underscores) → the field it sets.
FLAG_NAMES: dict[str, str] = {
    "data": "data",
    "out": "out",
    "steps": "steps",
    "prompts_per_step": "prompts_per_step",
    "on_bad_row": "on_bad_row",
    "engine_url": "runtime.engine.urls",
    "model": "runtime.engine.model",
    "n": "runtime.scheduler.n",
    "concurrency": "runtime.scheduler.concurrency",
    "max_new_tokens": "runtime.agent.max_new_tokens_per_turn",
    "temperature": "runtime.agent.sampling.temperature",
    "seed": "runtime.agent.sampling.seed",
    "ray": "runtime.ray.enabled",
    "ray_address": "runtime.ray.address",
    "ray_workers": "runtime.ray.num_workers",
}


class ConfigError(ValueError):
    """A configuration problem; the message names the field and the file position or flag."""


def _flag_key_hint(key: Any) -> str | None:
    """For a top-level key spelled as a flag (`n`, `engine-url`), what to write instead."""
    if not isinstance(key, str):
        return None
    name = key.replace("-", "_")
    dotted = FLAG_NAMES.get(name)
    if dotted is None or dotted == key:
        return None
    return f"`{key}` is the flag --{name.replace('_', '-')}; in the file write it as {dotted}"


def _deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for k, v in override.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class RolloutConfig(Strict):
    """Everything `agentloop rollout` needs. Unknown keys are errors (a typo must not be ignored)."""

    data: str | None = Field(
        None,
        description="Prompt dataset (.jsonl or .parquet). None: the bundled arithmetic prompts "
        "(agentloop/data/arithmetic.jsonl).",
    )
    out: str = Field("agentloop-out", description="Output folder: trajectories.jsonl/.parquet, summary.json, timeline.png, training.png.")
    steps: int = Field(2, ge=1, description="Training steps to run: each is wake-up → roll out → sleep.")
    prompts_per_step: int | None = Field(
        16,
        ge=1,
        description="Prompts each step takes from the dataset, in order, wrapping around. None: every row each step. "
        "With runtime.scheduler.target_groups set, a step launches ceil(target_groups x oversample_factor) groups "
        "instead, the groups carried over from the previous step included.",
    )
    on_bad_row: Literal["skip", "stop"] = Field(
        "skip",
        description="A dataset row that cannot be used: 'skip' it (counted and reported) or 'stop' the run.",
    )
    overwrite: bool = Field(
        False,
        description="Replace the previous run in a non-empty `out` folder. Without it a non-empty folder is refused "
        "(exit 2) before any engine starts, so a re-run never deletes earlier results silently.",
    )
    quiet: bool = Field(False, description="Plain log lines instead of the live progress display.")
    timeline: bool = Field(True, description="Draw timeline.png (trajectories over time, lifecycle stages) and "
                           "training.png (reward, response length, tool calls, status, tokens/s per step).")
    runtime: RuntimeConfig = Field(
        default_factory=lambda: RuntimeConfig.model_validate(ROLLOUT_RUNTIME_DEFAULTS),
        description="Runtime settings: engines, scheduler, agent loops (agentloop.config.RuntimeConfig).",
    )

    @model_validator(mode="before")
    @classmethod
    def _runtime_defaults(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and isinstance(data.get("runtime"), Mapping):
            data = dict(data)
            data["runtime"] = _deep_merge(ROLLOUT_RUNTIME_DEFAULTS, data["runtime"])
        return data


# ------------------------------------------------------------------------------------ YAML loading
def _node_at(root: yaml.Node | None, loc: tuple[Any, ...], *, key: bool = False) -> tuple[yaml.Node | None, bool]:
    """The YAML node at a pydantic error location (deepest existing one), and whether it is exact.

    The value node for a bad scalar; the key node for a mapping/list value or when `key` is set
    (an unknown field: that is where a reader looks for the typo)."""
    node = root
    found_key: yaml.Node | None = None
    for i, part in enumerate(loc):
        found_key = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(part):
                    found_key, node = k, v
                    break
            else:
                return node, False
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
        else:
            return node, False
    if found_key is not None and (key or not isinstance(node, yaml.ScalarNode)):
        return found_key, True
    return node, True


def _where(path: str | None, node: yaml.Node | None) -> str:
    if path is None:
        return "<defaults>"
    if node is None:
        return str(path)
    m = node.start_mark
    return f"{path}:{m.line + 1}:{m.column + 1}"


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = data
    for p in parts[:-1]:
        nxt = cur.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[p] = nxt
        cur = nxt
    cur[parts[-1]] = value


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, tuple[Any, str]] | None = None,
) -> RolloutConfig:
    """Read `path` (YAML; None: defaults only), apply `overrides` ({dotted.field: (value, "--flag")}),
    validate. Raises `ConfigError` naming the field and file:line:column (or the flag)."""
    root: yaml.Node | None = None
    data: Any = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"{p}: cannot read config file: {e.strerror or e}") from None
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
            data = strict_yaml_load(text)  # a key given twice is an error, not a silently lost setting
        except yaml.YAMLError as e:
            where = mark_where(p, e)
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError(f"{where}: invalid YAML: {problem}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{_where(str(p), root)}: the config file must be a mapping of fields, not a "
                              f"{type(data).__name__}")
    flag_of: dict[tuple[str, ...], str] = {}
    for dotted, (value, flag) in (overrides or {}).items():
        _set_dotted(data, dotted, value)
        flag_of[tuple(dotted.split("."))] = flag
    try:
        return RolloutConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = tuple(err["loc"])
            field = ".".join(str(x) for x in loc) or "<config>"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                hint = _flag_key_hint(loc[0]) if len(loc) == 1 else None
                msg = hint or "unknown field (not a setting of agentloop rollout; see `agentloop config --show`)"
            flag = next((f for k, f in flag_of.items() if loc[: len(k)] == k), None)
            if flag is not None:
                lines.append(f"{flag}: {field}: {msg}")
                continue
            node, exact = _node_at(root, loc, key=err["type"] == "extra_forbidden")
            where = _where(str(path) if path is not None else None, node)
            got = f" (got {err['input']!r})" if exact and err["type"] != "extra_forbidden" and not isinstance(
                err.get("input"), (dict, list)) else ""
            lines.append(f"{where}: {field}: {msg}{got}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


# ------------------------------------------------------------------------------- documented YAML
def _model_type(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class inside `X`, `X | None` or `Optional[X]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        for a in get_args(annotation):
            if isinstance(a, type) and issubclass(a, BaseModel):
                return a
    return None


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _flag_note(dotted: str) -> str:
    """The note on the flag that sets `dotted` (and its top-level key), for `config --show`."""
    switches = {"quiet": " Flag: -q, --quiet.", "overwrite": " Flag: --overwrite.",
                "timeline": " Flag: --no-timeline (sets false)."}
    dest = next((d for d, f in FLAG_NAMES.items() if f == dotted), None)
    if dest is None:
        return switches.get(dotted, "")
    flag = "--" + dest.replace("_", "-")
    return f" Flag: {flag}."


def _library_note(dotted: str, value: Any) -> str:
    """For a `runtime.*` field whose rollout default (`ROLLOUT_RUNTIME_DEFAULTS`) is not the library's
    (`RuntimeConfig()`, what a trainer's `Runtime` gets), say so, with the library's value."""
    if not dotted.startswith("runtime."):
        return ""
    library: Any = RuntimeConfig()
    for part in dotted.split(".")[1:]:
        library = getattr(library, part)
    if isinstance(library, BaseModel) or library == value:
        return ""
    return f" agentloop rollout's default; the library's (Runtime) is {_scalar(library)}."


def _render(model: BaseModel, indent: int, prefix: str = "") -> list[str]:
    pad = "  " * indent
    lines: list[str] = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        desc = (info.description or "") + _flag_note(prefix + name) + _library_note(prefix + name, value)
        sub = _model_type(info.annotation)
        if lines and indent == 0:
            lines.append("")
        for chunk in _wrap(desc, 96 - len(pad)):
            lines.append(f"{pad}# {chunk}")
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{name}:")
            lines.extend(_render(value, indent + 1, f"{prefix}{name}."))
        elif value is None and sub is not None:
            lines.append(f"{pad}{name}: null   # a mapping of: {', '.join(sub.model_fields)}")
        else:
            lines.append(f"{pad}{name}: {_scalar(value.value if hasattr(value, 'value') else value)}")
    return lines


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width=max(width, 40), break_on_hyphens=False) if text else []


def defaults_yaml(config: RolloutConfig | None = None) -> str:
    """Every setting with its description, as a commented YAML file that `load_config` accepts."""
    config = config or RolloutConfig()
    head = ["# agentloop rollout configuration (defaults). Pass with: agentloop rollout --config FILE.yaml",
            "# Command-line flags override the file ('Flag:' below says which sets a field). Unknown keys are",
            "# errors; the file uses this nested layout (runtime.scheduler.n, not a top-level n).",
            "# Where the command's default differs from the library's (a trainer's Runtime), the comment",
            "# says \"agentloop rollout's default\" and gives the library's value.", ""]
    return "\n".join(head + _render(config, 0)) + "\n"
