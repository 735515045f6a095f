"""`agentloop rollout`'s command line: its flags, and how they map onto `RolloutConfig` fields.

Kept apart from the run itself (`rollout.py`) so building the parser imports no runtime or engine.
"""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from ..config.rollout import FLAG_NAMES, ConfigError, RolloutConfig

#: flag dest → (dotted config field, flag as typed). Flags override the YAML file.
FLAG_FIELDS: dict[str, tuple[str, str]] = {
    dest: (dotted, "--" + dest.replace("_", "-")) for dest, dotted in FLAG_NAMES.items()
}


def _default(dotted: str) -> Any:
    obj: Any = RolloutConfig()
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _concurrency(text: str) -> int | str:
    """`--concurrency`: a positive integer or `auto` (range checks are the config's, which names the flag)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {text!r}") from None


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "rollout",
        help="roll out a prompt dataset into trajectories (JSONL, Parquet, summary.json, timeline.png, training.png)",
        description="Turn a prompt dataset into trajectory files, one training step at a time. "
        "Defaults of every setting: `agentloop config --show`.",
    )

    def h(dest: str, text: str) -> str:
        dotted, _ = FLAG_FIELDS[dest]
        return f"{text} (default: {_default(dotted)!r}; config field: {dotted})"

    p.add_argument("--config", metavar="FILE.yaml", help="YAML settings file (see `agentloop config --show`)")
    p.add_argument("--data", metavar="FILE", help=h("data", "prompts, .jsonl or .parquet; none: the bundled arithmetic prompts"))
    p.add_argument("--out", metavar="DIR", help=h("out", "output folder; a non-empty one is refused unless --overwrite"))
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="replace the previous run's files in a non-empty --out folder (config field: overwrite)")
    # extend + nargs="+": `--engine-url A B` and `--engine-url A --engine-url B` both give [A, B].
    p.add_argument("--engine-url", metavar="URL", action="extend", nargs="+",
                   help=h("engine_url", "running SGLang(-compatible) servers, one or several (`--engine-url A B`, or the "
                          "flag repeated). None: the embedded CPU engine"))
    p.add_argument("--model", metavar="DIR", help=h("model", "model folder for the embedded CPU engine"))
    p.add_argument("--steps", type=int, metavar="N", help=h("steps", "steps (wake-up → roll out → sleep)"))
    p.add_argument("--prompts-per-step", type=int, metavar="N", help=h("prompts_per_step", "prompts per step"))
    p.add_argument("--n", type=int, metavar="N", help=h("n", "trajectories per prompt (GRPO group size)"))
    p.add_argument("--concurrency", type=_concurrency, metavar="N|auto",
                   help=h("concurrency", "trajectories in flight at once; auto: what the engines can run"))
    p.add_argument("--max-new-tokens", type=int, metavar="N", help=h("max_new_tokens", "tokens per model turn"))
    p.add_argument("--temperature", type=float, metavar="T", help=h("temperature", "sampling temperature"))
    p.add_argument("--seed", type=int, metavar="S", help=h("seed", "sampling seed: makes the run repeatable; each sample and turn gets its own "
                                                  "seed derived from it, so GRPO groups stay diverse"))
    ray = p.add_argument_group("Ray mode", "workers and engines as Ray actors, on this machine or a cluster "
                               "(docs/distributed.md); needs `pip install 'agentloop[ray]'`")
    ray.add_argument("--ray", action="store_true", default=None,
                     help=h("ray", "run on Ray: agent-loop worker actors and engine server actors"))
    ray.add_argument("--ray-address", metavar="ADDR",
                     help=h("ray_address", "Ray cluster to use: none = start a local Ray, 'auto' = the cluster this "
                            "node joined (`ray start`), 'ray://HEAD:10001' = Ray Client from outside; implies --ray"))
    ray.add_argument("--ray-workers", type=int, metavar="N",
                     help=h("ray_workers", "agent-loop worker actors; implies --ray"))
    p.add_argument("--on-bad-row", choices=("skip", "stop"), help=h("on_bad_row", "what a bad dataset row does"))
    p.add_argument("--set", metavar="FIELD=VALUE", action="append", default=[],
                   help="set any config field by its dotted name, VALUE parsed as YAML "
                   "(e.g. --set runtime.scheduler.trajectory_timeout=30)")
    p.add_argument("-q", "--quiet", action="store_true", default=None, help="plain log lines instead of the live display")
    p.add_argument("--no-timeline", dest="timeline", action="store_false", default=None, help="do not draw timeline.png and training.png")
    return p


def overrides_from_args(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """{dotted field: (value, flag)} for every flag given on the command line."""
    out: dict[str, tuple[Any, str]] = {}
    for item in getattr(args, "set", None) or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set steps=3")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: VALUE is not valid YAML: {e}") from None
        out[key.strip()] = (value, f"--set {key.strip()}")
    for dest, (dotted, flag) in FLAG_FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            out[dotted] = (value, flag)
    for dest in ("ray_address", "ray_workers"):
        # Typing a Ray setting on the command line means Ray mode; in a file it may wait for `ray: true`.
        if getattr(args, dest, None) is not None and "runtime.ray.enabled" not in out:
            out["runtime.ray.enabled"] = (True, FLAG_FIELDS[dest][1])
    if getattr(args, "overwrite", None):
        out["overwrite"] = (True, "--overwrite")
    if getattr(args, "quiet", None):
        out["quiet"] = (True, "--quiet")
    if getattr(args, "timeline", None) is False:
        out["timeline"] = (False, "--no-timeline")
    return out
