"""A checkout never shadows the installed package.

The usual start: `git clone … agentloop`, then a `train.py` written next to the clone folder. With the
package at the repository's top level, `import agentloop` found the clone folder (which has no
`__init__.py`) as a namespace package before the editable install, `agentloop.tools` resolved to the
repository's own `tools/` scripts, and the README's trainer program failed with
`ModuleNotFoundError: No module named 'agentloop.tools.truncate'`. With the `src/` layout the clone's
top level holds no importable `agentloop`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _readme_trainer_program() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## In a trainer", 1)[1]
    return re.search(r"^```python\n(.*?)^```$", section, re.M | re.S).group(1)


def _clean_env() -> dict[str, str]:
    """The user's environment: the package as installed, nothing of this checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ENGINE_URL")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _installed_package_dir() -> Path:
    out = subprocess.run([sys.executable, "-c", "import agentloop, os; print(os.path.dirname(agentloop.__file__))"],
                         cwd="/", env=_clean_env(), capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip(f"agentloop is not installed in this interpreter: {out.stderr.strip()[-200:]}")
    return Path(out.stdout.strip())


def _clone_next_to(tmp_path: Path) -> Path:
    clone = tmp_path / "agentloop"
    if shutil.which("git") and (REPO / ".git").exists():
        subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True, timeout=120)
    else:  # an unpacked source archive: the same top-level folders
        shutil.copytree(REPO, clone, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info"))
    return clone


def test_the_checkout_has_no_top_level_package() -> None:
    assert not (REPO / "agentloop").exists(), "the package lives under src/; a top-level agentloop/ would shadow it"
    assert (REPO / "src" / "agentloop" / "__init__.py").is_file()


def test_imports_next_to_a_clone_resolve_to_the_installed_package(tmp_path: Path) -> None:
    installed = _installed_package_dir()
    clone = _clone_next_to(tmp_path)
    probe = ("import agentloop, agentloop.tools, agentloop.tools.truncate, os; "
             "print(os.path.dirname(agentloop.__file__)); print(os.path.dirname(agentloop.tools.__file__))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=_clean_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pkg, tools = out.stdout.split()
    assert Path(pkg) == installed and Path(tools) == installed / "tools"
    assert clone not in Path(pkg).parents


@pytest.mark.slow
def test_readme_trainer_program_runs_next_to_a_fresh_clone(tmp_path: Path) -> None:
    _installed_package_dir()
    _clone_next_to(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(_readme_trainer_program(), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_clean_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("non-zero advantages") == 2, proc.stdout  # one line per step, two steps
