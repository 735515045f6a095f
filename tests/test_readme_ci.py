"""README's whole-suite command is exactly what CI runs: README says `bash .ci/run`, and the bash block after
"The file's commands" holds the command lines of `.ci/run` (comments, `set -euo pipefail` and the `cd` to the
checkout left out), so a reader installs what CI installs and runs what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def ci_commands() -> list[str]:
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    return [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")
            and not ln.startswith(("set -euo", 'cd "$(dirname'))]


def test_readme_suite_command_is_ci_run() -> None:
    readme = (REPO / "README.md").read_text()
    m = re.search(r"The file's commands, which.*?```bash\n(.*?)```", readme, re.S)
    assert m, "README.md has no whole-suite command block"
    assert m.group(1).splitlines() == ci_commands()
    assert ci_commands()[-1].startswith("python -m pytest")  # the block ends in the suite, as CI's does


def test_readme_names_ci_run_as_the_suite_command() -> None:
    readme = (REPO / "README.md").read_text()
    assert re.search(r"exactly as CI does:\n\n```bash\nbash \.ci/run\n```", readme)
