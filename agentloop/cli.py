"""The `agentloop` command: `rollout` (the main job), `serve` (the CPU reference engine), `config`, `bench`.

Each subcommand lives in its own module and exposes `add_parser(subparsers)` and `run(args) -> int`;
this file only dispatches. Building the parser imports no subcommand's heavy dependencies (torch,
the runtime): those are imported by `run`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "rollout": "agentloop.commands.rollout_args",
    "config": "agentloop.commands.config",
    "serve": "agentloop.commands.serve",
    "bench": "agentloop.commands.bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentloop", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, mod in SUBCOMMANDS.items():
        try:
            importlib.import_module(mod).add_parser(sub)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
