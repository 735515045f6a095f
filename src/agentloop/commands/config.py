"""`agentloop config`: show the documented defaults of `agentloop rollout`, or check a config file.

`--show` prints every setting with its description as a commented YAML file (a valid config to
start from); `--check FILE.yaml` validates a file and prints the resolved settings, or the errors
with field names and file positions (exit status 2).
"""

from __future__ import annotations

import argparse
import sys

import yaml

from ..config.rollout import ConfigError, defaults_yaml, load_config


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("config", help="show the rollout config defaults (documented YAML) or check a file",
                              description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--show", action="store_true", help="print every setting with its default and description as YAML")
    g.add_argument("--check", metavar="FILE.yaml", help="validate a config file and print the resolved settings")
    return p


def run(args: argparse.Namespace) -> int:
    if args.show:
        sys.stdout.write(defaults_yaml())
        return 0
    try:
        cfg = load_config(args.check)
    except ConfigError as e:
        print(f"agentloop config: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return 0
