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


class SandboxError(AgentjetError):
    """The sandbox itself failed or was misused; the program it runs never raises this."""


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one program run.

    `exit_code` follows `subprocess`: negative means killed by that signal (-9 after a
    timeout). `error` is non-empty only when the sandbox could not run the program at all;
    `truncated` says that stdout or stderr was longer than the sandbox keeps.
    """

    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    timed_out: bool = False
    error: str = ""
    truncated: bool = False

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
