"""What `agentloop rollout` checks before any engine starts, so a run never fails minutes into the
engines' start-up for a typo: the embedded engine's model folder is a model (`model_problem`), the
output folder holds no earlier run unless `--overwrite` (`previous_run`), the tool config builds
(file:line of the problem), and the output folder can really be written (a temporary file is made
and removed there). The settings file and the data set are checked where they are read
(`load_config`, `load_dataset`); every problem found here is reported, and the command exits 2.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..config.rollout import RolloutConfig

__all__ = ["model_problem", "out_folder_problem", "preflight", "previous_run"]


def out_folder_problem(out: Path) -> str | None:
    """Why files cannot be written to `out`, or None. Tried for real (permission bits say nothing to
    root, nor about a read-only or full file system): a temporary file is created and removed in
    `out`, or in its nearest existing parent when `out` does not exist yet (nothing is left behind)."""
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"--out {out}: {probe} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        # The errno alone misleads: creating in /proc fails with "No such file or directory" although
        # /proc exists. Say which folder refused new files, then the system's reason.
        if probe == out:
            return f"--out {out}: files cannot be created in this folder (the system says: {e.strerror or e})"
        return (f"--out {out}: cannot be created: its nearest existing parent, {probe}, does not accept new "
                f"files or folders (the system says: {e.strerror or e})")
    return None


def preflight(cfg: RolloutConfig) -> list[str]:
    """Every problem found in what the run will need, each naming its file (and line) or flag."""
    problems: list[str] = []
    tools = cfg.runtime.agent.tools
    if tools is not None:
        from ..tools.registry import ToolConfigError, ToolRegistry

        try:
            ToolRegistry.from_yaml(tools)
        except ToolConfigError as e:
            problems.append(f"tools: {e}")
    problem = out_folder_problem(Path(cfg.out))
    if problem is not None:
        problems.append(problem)
    return problems


def model_problem(cfg: RolloutConfig) -> str | None:
    """Why the embedded engine's model folder cannot be served (a bad setting, exit 2), or None.
    Not checked for a Ray cluster given by address: the folder need only exist on its nodes."""
    eng = cfg.runtime.engine
    if eng.model is None or eng.urls or eng.launch is not None or cfg.runtime.ray.address:
        return None
    model = Path(eng.model)
    if not model.is_dir():
        return f"--model {model} (runtime.engine.model): no such folder"
    if not (model / "config.json").is_file():
        return f"--model {model} (runtime.engine.model): no config.json in it (a Hugging Face model folder is needed)"
    return None


def previous_run(out: Path) -> str | None:
    """Why `out` may not be written without --overwrite (it holds files), or None."""
    if not out.exists():
        return None
    if not out.is_dir():
        return f"--out {out} is a file, not a folder"
    held = sorted(p.name for p in out.iterdir())
    if not held:
        return None
    shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
    return (f"output folder {out} is not empty ({shown}); pass --overwrite to replace its run's files "
            f"(config: overwrite: true), or give another --out")
