"""What a Python interpreter needs on disk to start: its binary, the directories of its standard library
and the shared objects that the binary and the stdlib's extension modules load (found once with `ldd`).

The kernel sandbox mounts exactly these, read-only, into an otherwise empty root, so the facts are
probed once per interpreter and process (`interpreter_files`) and cached.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import subprocess
from dataclasses import dataclass

__all__ = ["InterpreterFiles", "interpreter_files", "shared_libraries"]

# Printed by the interpreter itself: sys.path under -I -S is exactly what it imports the stdlib from.
_FACTS = (
    "import json, os, sys, site\n"
    "print(json.dumps({'executable': os.path.realpath(sys.executable), 'prefix': sys.base_prefix,\n"
    "                  'version': '%d.%d' % sys.version_info[:2], 'site': site.getsitepackages()}))\n"
)
_PATH = "import json, sys; print(json.dumps(sys.path))"
# Extension modules whose libraries the sandbox never needs (GUI toolkits, CPython's own test modules).
_SKIP_EXTENSIONS = ("_tkinter", "_test", "xxlimited", "_xx", "_ctypes_test")


@dataclass(frozen=True)
class InterpreterFiles:
    """Absolute host paths; `executable` is the real binary (symlinks of a virtualenv resolved)."""

    executable: str
    prefix: str
    version: str
    stdlib: tuple[str, ...]  # sys.path of `executable -I -S`, existing entries only
    site_packages: tuple[str, ...]  # of the configured interpreter (a virtualenv's own)
    libraries: tuple[str, ...]  # shared objects, ld.so included


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={}, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed (exit {r.returncode}): {r.stderr.strip()[:500]}")
    return r.stdout


def shared_libraries(binaries: list[str]) -> tuple[str, ...]:
    """The shared objects `binaries` load, as `ldd` resolves them (ld.so included)."""
    libs: set[str] = set()
    for line in _run(["ldd", *binaries]).splitlines():
        parts = line.split()
        if not parts or line.rstrip().endswith(":"):  # "path:" headers when ldd gets several files
            continue
        if len(parts) >= 3 and parts[1] == "=>" and parts[2].startswith("/"):
            libs.add(parts[2])
        elif parts[0].startswith("/"):  # the dynamic loader: "/lib64/ld-linux-x86-64.so.2 (0x...)"
            libs.add(parts[0])
    return tuple(sorted(libs))


@functools.lru_cache(maxsize=8)
def interpreter_files(python: str) -> InterpreterFiles:
    """Probe `python` (blocking: a few interpreter starts and one `ldd`); cached per process."""
    facts = json.loads(_run([python, "-I", "-c", _FACTS]))
    exe = facts["executable"]
    stdlib = tuple(p for p in json.loads(_run([exe, "-I", "-S", "-c", _PATH])) if p and os.path.exists(p))
    extensions = [
        so for d in stdlib if os.path.isdir(d) for so in glob.glob(os.path.join(d, "*.so"))
        if not os.path.basename(so).startswith(_SKIP_EXTENSIONS)
    ]
    return InterpreterFiles(
        executable=exe,
        prefix=facts["prefix"],
        version=facts["version"],
        stdlib=stdlib,
        site_packages=tuple(p for p in facts["site"] if os.path.isdir(p)),
        libraries=shared_libraries([exe, *extensions]),
    )
