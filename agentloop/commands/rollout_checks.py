"""What `agentloop rollout` checks before any engine starts, so a run never fails minutes into the
engines' start-up for a typo: the tool config builds (file:line of the problem), and the output
folder can really be written (a temporary file is made and removed there). The settings file and the
data set are checked where they are read (`load_config`, `load_dataset`); every problem found here is
reported at once, and the command exits 2.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..rollout_config import RolloutConfig

__all__ = ["out_folder_problem", "preflight"]


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
        return f"--out {out}: cannot write there ({probe}: {e.strerror or e})"
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
