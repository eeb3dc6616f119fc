"""The sandbox interface every backend (local process, docker) implements.

    environment ── exec(code, timeout_s) ──▶ Sandbox ──▶ ExecResult(stdout, stderr, exit code, …)
                ── put_file / get_file ───▶ (its private work dir)

A sandbox runs untrusted, model-written programs. What the *program* does wrong — loops
forever, exhausts memory, floods its output, crashes — is reported in the `ExecResult`,
never raised: to an RL environment it is an observation and a reward, not an error.
`SandboxError` is only for misuse (a path outside the work dir, exec before start) and for
a sandbox that cannot be set up at all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Self

from agentjet.errors import AgentjetError

# Bytes of stdout and of stderr kept per exec; the rest is read and dropped, so a program
# printing in a loop cannot grow the caller's memory.
MAX_OUTPUT_BYTES = 64 * 1024

# What an exec runs: Python source, or a command line for /bin/sh.
Language = Literal["python", "sh"]

# Environment variables of every program, on every backend (each adds PATH, HOME, TMPDIR).
PROGRAM_ENVIRONMENT = {
    "LANG": "C.UTF-8",
    # Partial output of a program that later times out still reaches the caller.
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    # HOME is the writable work dir: without this a program could plant a usercustomize.py
    # there that runs first in every later Python process, the task's check included.
    "PYTHONNOUSERSITE": "1",
    # One thread per numeric library: thread pools would eat the memory limits.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

# Why a run went wrong: `ExecResult.fault`, and per episode in `Episode.faults`, the
# trajectory's samples and the rollout node's metrics.
FAULT_TIMEOUT = "timeout"  # killed at the wall-clock limit
FAULT_OOM = "oom_killed"  # killed by the kernel for exceeding the memory limit
FAULT_PIDS = "pids_limit"  # a fork was refused: the process-count limit was reached
FAULT_LOST = "sandbox_lost"  # the sandbox itself is gone (a container killed from outside)
FAULT_UNAVAILABLE = "no_sandbox"  # no sandbox could be had (pool busy, engine down)
FAULTS = (FAULT_TIMEOUT, FAULT_OOM, FAULT_PIDS, FAULT_LOST, FAULT_UNAVAILABLE)


class SandboxError(AgentjetError):
    """The sandbox itself failed or was misused; the program it runs never raises this."""


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one program run.

    `exit_code` follows `subprocess`: negative means killed by that signal (-9 after a
    timeout). `error` is non-empty only when the sandbox could not run the program at all;
    `truncated` says that stdout or stderr was longer than the sandbox keeps. `fault` names
    the limit or failure that ended the run (one of FAULTS), "" when none did.
    """

    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    timed_out: bool = False
    error: str = ""
    truncated: bool = False
    fault: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.error


class Sandbox(ABC):
    """An isolated place to run programs, with a work dir that persists across execs.

    Usage: `with ProcessSandbox() as box: box.exec("print(1)", timeout_s=5)`. One sandbox
    serves one caller at a time; run programs concurrently with several sandboxes.
    """

    @abstractmethod
    def start(self) -> None:
        """Create the work dir (and container, where there is one). Calling it twice is a no-op."""

    @abstractmethod
    def exec(self, code: str, timeout_s: float, *, language: Language = "python") -> ExecResult:
        """Run `code` in the work dir, killing it and everything it started after `timeout_s`."""

    @abstractmethod
    def put_file(self, path: str, data: bytes) -> None:
        """Write `data` to `path`, relative to the work dir (parents are created)."""

    @abstractmethod
    def get_file(self, path: str) -> bytes:
        """Read `path`, relative to the work dir; SandboxError when it is missing or outside."""

    @abstractmethod
    def reset(self) -> None:
        """Return to a fresh, empty work dir, as if just started."""

    @abstractmethod
    def close(self) -> None:
        """Release everything the sandbox holds. Calling it twice is a no-op."""

    def healthy(self) -> bool:
        """Whether the sandbox can still run programs (a pool replaces one that cannot)."""
        return True

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class BoundedBuffer:
    """Keeps the first `limit` bytes written to it and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: list[bytes] = []
        self.kept = 0
        self.dropped = 0

    def append(self, chunk: bytes) -> None:
        room = self.limit - self.kept
        if room > 0:
            self.chunks.append(chunk[:room])
            self.kept += min(room, len(chunk))
        self.dropped += max(0, len(chunk) - room)

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


class ProgramOutput:
    """A program's stdout and stderr as the runner's output frames bring them, each bounded."""

    def __init__(self, limit: int) -> None:
        self.stdout = BoundedBuffer(limit)
        self.stderr = BoundedBuffer(limit)

    def frame(self, kind: bytes, payload: bytes) -> None:
        """An "o" (stdout) or "e" (stderr) frame's payload (sandboxes/runner.py)."""
        (self.stdout if kind == b"o" else self.stderr).append(payload)

    def truncated(self, dropped_by_runner: int) -> bool:
        return dropped_by_runner > 0 or self.stdout.dropped > 0 or self.stderr.dropped > 0
