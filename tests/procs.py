"""Reading the process table in tests (found by PID, never matched by name)."""

from __future__ import annotations

import contextlib
from pathlib import Path


def command_line(pid: int) -> str:
    """`pid`'s command line, its arguments joined by spaces ("" once it is gone)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""
