"""The `agentloop` command: `rollout` (the main job), `serve` (the CPU reference engine), `config`, `bench`.

Each subcommand has a module with `add_parser(subparsers)` and a module with `run(args) -> int` (the
same one, or two when the run's imports are heavy: `rollout_args` / `rollout`); this file only
dispatches. Building the parser imports no subcommand's heavy dependencies (torch, the runtime):
the run's module is imported only for the command that runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: command -> (module defining `add_parser`, module defining `run`)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "rollout": ("agentloop.commands.rollout_args", "agentloop.commands.rollout"),
    "config": ("agentloop.commands.config",) * 2,
    "serve": ("agentloop.commands.serve",) * 2,
    "bench": ("agentloop.commands.bench",) * 2,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentloop", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for mod, _ in SUBCOMMANDS.values():
        try:
            importlib.import_module(mod).add_parser(sub)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(SUBCOMMANDS[args.command][1]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
