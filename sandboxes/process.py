"""ProcessSandbox: programs run as local subprocesses, the embedded default where no docker runs.

    start() ──▶ [bwrap …] python -c RUNNER   (one warm runner per sandbox: sandboxes/runner.py)
    exec(code) ──▶ runner: fork ──▶ child: own session, rlimits, minimal env, cwd = the
                   private work dir, then the program ──▶ output frames ──▶ ExecResult

Isolation, from weakest guarantee to strongest:

- a private temp work dir (a new one at a new path on every `reset`), handled without
  following links, so a program cannot steer put_file/get_file/reset outside it; and a
  minimal environment: no variable of the parent (API keys, tokens) reaches the runner or
  the program, but for the node's lifeline mark (agentjet/lifeline.py: both end if the
  node dies);
- rlimits set in the program's process before it runs: CPU seconds, address space, file
  size, open files, processes, no core dumps;
- its own session and process group: on timeout, and after every run, the whole group is
  killed by its id (`os.killpg`), so children it left behind die with it;
- under bubblewrap (`bwrap`), when installed: the root filesystem read-only, a private /tmp,
  only the sandbox's own dir writable, and new user, pid, net, ipc and uts namespaces, so no
  network and no view of other processes. Without bwrap the program can do whatever the
  parent's user can (as root: anything) and can reach the network; it is then a bound on
  faults, not a security boundary: use bwrap or the docker backend for code you distrust.

The runner outlives each program, so a program could try to reach the next one through
it: it is not dumpable (no ptrace, no /proc/PID/fd of it without CAP_SYS_PTRACE, which
bwrap drops), and a program that kills it ends its own run with fault `sandbox_lost`; the
next exec starts a new runner.

Known limits of this backend:

- RLIMIT_NPROC counts every process of the user, and Linux does not enforce it for root
  (CAP_SYS_RESOURCE/CAP_SYS_ADMIN). As root without bwrap a fork bomb is bounded only by
  the timeout and the CPU limit per process. Under bwrap's user namespace (Linux >= 5.14)
  the count is per namespace and holds.
- A program that calls setsid() leaves the process group; it is then bounded only by its
  CPU limit (bwrap's pid namespace ends it with the runner).
- Without bwrap, a program running as the runner's user (root included) can reach the
  runner, and through it the programs after it in the same sandbox: the same bound as
  above, not a boundary.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agentjet import lifeline
from sandboxes import runner
from sandboxes.base import (
    FAULT_LOST,
    FAULT_TIMEOUT,
    MAX_OUTPUT_BYTES,
    PROGRAM_ENVIRONMENT,
    ExecResult,
    Language,
    ProgramOutput,
    Sandbox,
    SandboxError,
)

# Seconds of CPU beyond the wall-clock timeout before the kernel kills a process: the
# timeout fires first, the CPU limit catches processes that escaped the group.
CPU_LIMIT_MARGIN_S = 1
# The runner ends a program at its timeout; one that has not answered this long after it
# is stuck, and is replaced (the run's fault: sandbox_lost).
RUNNER_GRACE_S = 5.0
# How long a runner may take to start (interpreter and bwrap start-up, a loaded machine).
RUNNER_START_TIMEOUT_S = 30.0

# Where programs look for executables; nothing from the parent's PATH (pyenv shims, venvs).
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class ResourceLimits:
    """Per-process limits of a sandboxed program (the CPU limit follows each exec's timeout)."""

    # Address space: enough for Python with numpy, small enough that ten hogs fit in RAM.
    memory_bytes: int = 1 << 30
    # Largest file the program may write.
    file_bytes: int = 64 << 20
    # Processes of the user (see the module docstring for why this is weak).
    processes: int = 256
    open_files: int = 256


class ProcessSandbox(Sandbox):
    """Runs programs through a warm runner in a private temp dir; see the module docstring."""

    def __init__(
        self,
        *,
        limits: ResourceLimits | None = None,
        python: str = sys.executable,
        use_bwrap: bool | None = None,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
    ) -> None:
        """`use_bwrap`: None = when `bwrap` is installed. `python` runs the Python programs."""
        self.limits = limits or ResourceLimits()
        self.python = python
        bwrap = shutil.which("bwrap")
        if use_bwrap and bwrap is None:
            raise SandboxError("use_bwrap=True but bwrap is not installed (apt install bubblewrap)")
        self.bwrap = bwrap if use_bwrap is not False else None
        self.max_output_bytes = max_output_bytes
        self._root: Path | None = None
        self._resets = 0
        self._runner: subprocess.Popen[bytes] | None = None
        self._link: runner.RunnerLink | None = None

    @property
    def work_dir(self) -> Path:
        """The program's cwd and HOME; put_file/get_file paths are relative to it."""
        return self._started_root() / f"work-{self._resets}"

    def _started_root(self) -> Path:
        if self._root is None:
            raise SandboxError("the sandbox is not started: call start() first")
        return self._root

    def start(self) -> None:
        if self._root is not None:
            return
        try:
            self._root = Path(tempfile.mkdtemp(prefix="agentjet-sandbox-"))
            self.work_dir.mkdir()
        except OSError as e:
            raise SandboxError(
                f"cannot create a sandbox dir in {tempfile.gettempdir()}: {e}"
            ) from None
        try:
            self._start_runner()
        except SandboxError:
            self.close()  # nothing left behind by a sandbox that never started
            raise

    def close(self) -> None:
        self._stop_runner()
        if self._root is not None:
            _remove_tree(self._root)
            self._root = None

    def healthy(self) -> bool:
        return self._runner is not None and self._runner.poll() is None

    def reset(self) -> None:
        """A new empty work dir at a new path (nothing may hold on to the old one); the
        runner stays."""
        old = self.work_dir
        self._resets += 1
        try:
            self.work_dir.mkdir()
        except OSError as e:
            raise SandboxError(f"cannot create a sandbox work dir: {e}") from None
        _remove_tree(old)

    def put_file(self, path: str, data: bytes) -> None:
        target = self._resolve(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        except OSError as e:
            raise SandboxError(f"cannot write {path!r} into the sandbox: {e.strerror}") from None

    def get_file(self, path: str) -> bytes:
        target = self._resolve(path)
        try:
            return target.read_bytes()
        except OSError as e:
            raise SandboxError(f"cannot read {path!r} from the sandbox: {e.strerror}") from None

    def exec(self, code: str, timeout_s: float, *, language: Language = "python") -> ExecResult:
        work = self.work_dir
        started = time.monotonic()
        try:
            source = runner.program_bytes(code)
        except ValueError as e:
            return _failed(started, f"cannot start the program: {e}")
        if not self.healthy():
            self._start_runner()  # the last program killed it
        assert self._link is not None
        header = {
            "op": "exec",
            "language": language,
            "cwd": str(work),
            "env": {
                "PATH": _SANDBOX_PATH,
                "HOME": str(work),
                "TMPDIR": str(work),
                **PROGRAM_ENVIRONMENT,
                **lifeline.mark(),  # the program ends with its node, even one killed
            },
            "timeout_s": timeout_s,
            "max_output": self.max_output_bytes,
            "limits": self._limits(timeout_s),
        }
        output = ProgramOutput(self.max_output_bytes)
        deadline = started + timeout_s + RUNNER_GRACE_S
        try:
            result = self._link.request(header, source, deadline, output.frame)
        except runner.RunnerGone as e:
            self._stop_runner()
            return ExecResult(
                stdout=output.stdout.text(),
                stderr=output.stderr.text(),
                exit_code=-1,
                duration_s=time.monotonic() - started,
                error=f"{e} during the program",
                fault=FAULT_LOST,
            )
        if result.get("error"):
            return _failed(started, f"cannot start the program: {result['error']}")
        timed_out = bool(result["timed_out"])
        return ExecResult(
            stdout=output.stdout.text(),
            stderr=output.stderr.text(),
            exit_code=int(result["exit_code"]),
            duration_s=time.monotonic() - started,
            timed_out=timed_out,
            truncated=output.truncated(int(result["dropped"])),
            fault=FAULT_TIMEOUT if timed_out else "",
        )

    def _limits(self, timeout_s: float) -> dict[str, int]:
        return {
            "RLIMIT_CPU": math.ceil(timeout_s) + CPU_LIMIT_MARGIN_S,
            "RLIMIT_AS": self.limits.memory_bytes,
            "RLIMIT_FSIZE": self.limits.file_bytes,
            "RLIMIT_NPROC": self.limits.processes,
            "RLIMIT_NOFILE": self.limits.open_files,
            "RLIMIT_CORE": 0,
        }

    def _start_runner(self) -> None:
        """A new runner for this sandbox (the last one, if any, is stopped first)."""
        self._stop_runner()
        root = self._started_root()
        argv = self._isolation_prefix(root) + [self.python, "-c", runner.source()]
        env = {"PATH": _SANDBOX_PATH, "HOME": str(root), **PROGRAM_ENVIRONMENT, **lifeline.mark()}
        try:
            proc = subprocess.Popen(
                argv,
                cwd=root,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            raise SandboxError(f"cannot start the sandbox runner: {e}") from None
        self._runner, self._link = proc, runner.pipe_link(proc)
        try:
            answer = self._link.request(
                {"op": "text", "paths": []}, deadline=time.monotonic() + RUNNER_START_TIMEOUT_S
            )
        except runner.RunnerGone as e:
            self._stop_runner()
            raise SandboxError(f"the sandbox runner did not start: {e}") from None
        if answer.get("error"):
            self._stop_runner()
            raise SandboxError(f"the sandbox runner did not start: {answer['error']}")

    def _stop_runner(self) -> None:
        """End the runner: its stdin closes (it exits), then its session is killed."""
        proc, self._runner, self._link = self._runner, None, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        if proc.poll() is None:
            _kill_group(proc.pid)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def _isolation_prefix(self, root: Path) -> list[str]:
        if self.bwrap is None:
            return []
        # The interpreter's installation (a venv: two levels up) stays visible when it
        # lives under /tmp, which the sandbox replaces with an empty tmpfs.
        prefix = Path(self.python).absolute().parent.parent
        return bwrap_argv(self.bwrap, root, keep=[prefix])

    def _resolve(self, path: str) -> Path:
        """`path` inside the work dir, following symlinks: a program must not be able to
        plant a link that makes put_file/get_file touch the host."""
        if self.work_dir.is_symlink():
            raise SandboxError("the sandbox work dir was replaced by a link; reset() it")
        work = self.work_dir.resolve()
        target = (work / path).resolve()
        if not target.is_relative_to(work) or target == work:
            raise SandboxError(f"{path!r} is not a file path inside the sandbox work dir")
        return target


def bwrap_argv(bwrap: str, sandbox_dir: Path, keep: list[Path] | None = None) -> list[str]:
    """The bubblewrap prefix: read-only root filesystem, a private /tmp, only the sandbox's
    dir writable, fresh namespaces (no network). `keep`: paths under /tmp that stay
    visible, read-only (the interpreter's installation). Not --die-with-parent: that signal
    follows the thread that started bwrap, and a runner outlives it; the runner exits when
    its stdin closes, and carries the node's lifeline mark."""
    kept = [path for path in keep or [] if path.is_relative_to("/tmp")]
    return [
        bwrap,
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        *[arg for path in kept for arg in ("--ro-bind", str(path), str(path))],
        "--bind", str(sandbox_dir), str(sandbox_dir),
        "--chdir", str(sandbox_dir),
        "--unshare-all",
        "--",
    ]  # fmt: skip


def _failed(started: float, error: str) -> ExecResult:
    return ExecResult(
        stdout="", stderr="", exit_code=-1, duration_s=time.monotonic() - started, error=error
    )


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(pgid, signal.SIGKILL)


def _remove_tree(path: Path) -> None:
    """Delete `path`, even where the program made directories unreadable or read-only, and
    without following links out of it (a link in place of `path` itself is just removed)."""
    try:
        if path.is_symlink() or not path.exists():
            path.unlink(missing_ok=True)
            return
        os.chmod(path, 0o700)
        for parent, dirnames, _ in os.walk(path):
            for name in dirnames:
                child = os.path.join(parent, name)
                if not os.path.islink(child):  # chmod would follow the link out of the dir
                    os.chmod(child, 0o700)
        shutil.rmtree(path)
    except OSError as e:
        raise SandboxError(f"cannot remove the sandbox dir {path}: {e}") from None
