"""Files written whole or not at all: `atomic_write` writes a temporary file next to the target,
fsyncs it and renames it over the target, so no reader ever sees a half-written file (and a failed
write leaves the old file, or none). `FILE_MODE` is the mode ordinary output files get.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO, Callable

__all__ = ["FILE_MODE", "atomic_write", "atomic_write_text"]


def _file_mode() -> int:
    # mkstemp creates 0600 files; outputs are ordinary files, so give them the umask's usual mode.
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


FILE_MODE = _file_mode()


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Call `write(f)` on a temp file next to `path`, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))
