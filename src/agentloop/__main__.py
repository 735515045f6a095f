"""`python -m agentloop ...`: the same command as the `agentloop` script (`agentloop.cli.main`)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
