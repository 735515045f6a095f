"""Where model-written code runs: the kernel sandbox (namespaces + minimal root via bubblewrap, seccomp,
rlimits; `namespaces.py`, `policy.py`, `interpreter.py`), the process runner shared by the local modes
(`process.py`) and a SandboxFusion-compatible remote backend (`fusion.py`). docs/sandbox.md has the
threat model. Layering: imports only `agentloop.tools.base`.
"""

from .namespaces import SandboxUnavailable
from .process import SandboxOutput

__all__ = ["SandboxOutput", "SandboxUnavailable"]
