"""The `agentloop` command: `rollout` (the main job), `serve` (the CPU reference engine), `config`, `bench`.

Each subcommand has a module with `add_parser(subparsers)` and a module with `run(args) -> int` (the
same one, or two when the run's imports are heavy: `rollout_args` / `rollout`); this file only
dispatches. Building the parser imports no subcommand's heavy dependencies (torch, the runtime):
the run's module is imported only for the command that runs.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

#: command -> (module defining `add_parser`, module defining `run`)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "rollout": ("agentloop.commands.rollout_args", "agentloop.commands.rollout"),
    "config": ("agentloop.commands.config",) * 2,
    "serve": ("agentloop.commands.serve",) * 2,
    "bench": ("agentloop.commands.bench",) * 2,
}

#: The commands whose process holds trajectories, tool outputs and request bodies, and no model: their
#: big transient buffers go back to the system (`agentloop.allocator`). Not `serve`: its model's forward
#: passes run in its process, and pinned thresholds slow torch's CPU work (the allocator's docstring).
TUNED_COMMANDS = frozenset({"rollout", "bench"})


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


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def _unknown_flags(sub: argparse.ArgumentParser, extra: list[str]) -> str:
    """The subcommand's own error for arguments it does not take, with the closest flags it does."""
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for arg in extra:
        if arg.startswith("-"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=2, cutoff=0.6)
            if close:
                hints.append(f"{arg.split('=', 1)[0]}: did you mean {' or '.join(close)}?")
    return f"unrecognized arguments: {' '.join(extra)}" + "".join(f"\n  {h}" for h in hints)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Parsed leniently first so an unknown flag is reported by its subcommand (its usage, and the
    # flag it was probably meant to be) rather than by the top-level parser, which knows none of them.
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = _subparser(parser, args.command)
        sub.error(_unknown_flags(sub, extra))
    if args.command in TUNED_COMMANDS:
        from .allocator import tune_allocator

        tune_allocator()
    return int(importlib.import_module(SUBCOMMANDS[args.command][1]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
