"""ProcessSandbox: programs run as local subprocesses, the embedded default where no docker runs.

    exec(code) ──▶ [bwrap …] python -c LAUNCHER <rlimits> <program…> ──▶ pipes ──▶ ExecResult
                    (own session, minimal env, cwd = private temp work dir)

Isolation, from weakest guarantee to strongest:

- a private temp work dir (wiped by `reset`), handled without following links, so a
  program cannot steer put_file/get_file/reset outside it; and a minimal environment: no
  variable of the parent (API keys, tokens) reaches the program, but for the node's
  lifeline mark (agentjet/lifeline.py: the program ends if the node dies);
- rlimits set by a tiny launcher just before exec: CPU seconds, address space, file size,
  open files, processes, no core dumps. A launcher, not `preexec_fn`, because environments
  run tool calls from a thread pool and `preexec_fn` is unsafe in a threaded parent;
- its own session and process group: on timeout, and after every run, the whole group is
  killed by its id (`os.killpg`), so children it left behind die with it;
- under bubblewrap (`bwrap`), when installed: the root filesystem read-only, a private /tmp,
  only the work dir writable, and new user, pid, net, ipc and uts namespaces, so no
  network and no view of other processes. Without bwrap the program can do whatever the
  parent's user can (as root: anything) and can reach the network; it is then a bound on
  faults, not a security boundary: use bwrap or the docker backend for code you distrust.

Known limits of this backend:

- RLIMIT_NPROC counts every process of the user, and Linux does not enforce it for root
  (CAP_SYS_RESOURCE/CAP_SYS_ADMIN). As root without bwrap a fork bomb is bounded only by
  the timeout and the CPU limit per process. Under bwrap's user namespace (Linux >= 5.14)
  the count is per namespace and holds.
- A program that calls setsid() leaves the process group; it is then bounded only by its
  CPU limit (bwrap's pid namespace ends it with the run).
"""

from __future__ import annotations

import contextlib
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agentjet import lifeline
from sandboxes.base import (
    FAULT_TIMEOUT,
    MAX_OUTPUT_BYTES,
    PROGRAM_ENVIRONMENT,
    BoundedBuffer,
    ExecResult,
    Language,
    Sandbox,
    SandboxError,
)

# After the program exits, output still buffered in the pipes is read for at most this
# long; only a process that escaped the group (setsid) can hold a pipe open past it.
PIPE_DRAIN_GRACE_S = 0.5
# One read from a pipe; the kernel's pipe buffer is 64 KiB.
READ_CHUNK_BYTES = 64 * 1024
# Seconds of CPU beyond the wall-clock timeout before the kernel kills a process: the
# timeout fires first, the CPU limit catches processes that escaped the group.
CPU_LIMIT_MARGIN_S = 1

# The launcher applies rlimits ("NAME=value,…" in argv[1]) to itself, then execs argv[2:].
# A limit is lowered to the existing hard limit when that is smaller (raising it would fail).
_LAUNCHER = """\
import os, resource, sys
for item in sys.argv[1].split(","):
    name, value = item.split("=")
    kind = getattr(resource, name)
    hard = resource.getrlimit(kind)[1]
    limit = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
    resource.setrlimit(kind, (limit, limit))
os.execv(sys.argv[2], sys.argv[2:])
"""

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
    """Runs programs as subprocesses in a private temp dir; see the module docstring."""

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

    @property
    def work_dir(self) -> Path:
        """The program's cwd and HOME; put_file/get_file paths are relative to it."""
        return self._started_root() / "work"

    def _started_root(self) -> Path:
        if self._root is None:
            raise SandboxError("the sandbox is not started: call start() first")
        return self._root

    def start(self) -> None:
        if self._root is not None:
            return
        try:
            self._root = Path(tempfile.mkdtemp(prefix="agentjet-sandbox-"))
            (self._root / "work").mkdir()
        except OSError as e:
            raise SandboxError(
                f"cannot create a sandbox dir in {tempfile.gettempdir()}: {e}"
            ) from None

    def close(self) -> None:
        if self._root is not None:
            _remove_tree(self._root)
            self._root = None

    def reset(self) -> None:
        """A new empty work dir (at a new path: nothing may hold on to the old one)."""
        self._started_root()
        self.close()
        self.start()

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
        program = [self.python, "-c", code] if language == "python" else ["/bin/sh", "-c", code]
        argv = self._isolation_prefix() + self._launcher(timeout_s) + program
        env = {
            "PATH": _SANDBOX_PATH,
            "HOME": str(work),
            "TMPDIR": str(work),
            **PROGRAM_ENVIRONMENT,
            **lifeline.mark(),  # the program ends with its node, even one killed
        }
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except (OSError, ValueError) as e:  # ValueError: a NUL byte in the code
            return ExecResult(
                stdout="",
                stderr="",
                exit_code=-1,
                duration_s=time.monotonic() - started,
                error=f"cannot start the program: {e}",
            )
        with proc:
            try:
                return self._collect(proc, started, started + timeout_s)
            except BaseException:
                _kill_group(proc.pid)  # never leave a program running behind an error
                raise

    def _collect(
        self, proc: subprocess.Popen[bytes], started: float, deadline: float
    ) -> ExecResult:
        """Read both pipes until the program ends or the deadline passes; kill its group.

        The program's exit is watched through a pidfd, which becomes readable on exit
        without reaping it: the loop sleeps in one `select` and wakes on output or exit.
        """
        assert proc.stdout is not None and proc.stderr is not None
        stdout = BoundedBuffer(self.max_output_bytes)
        stderr = BoundedBuffer(self.max_output_bytes)
        outputs = {proc.stdout.fileno(): stdout, proc.stderr.fileno(): stderr}
        exited = False
        with selectors.DefaultSelector() as selector, _pidfd(proc.pid) as exit_fd:
            for fd in (*outputs, exit_fd):
                selector.register(fd, selectors.EVENT_READ)
            while len(selector.get_map()) > (0 if exited else 1):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                for key, _ in selector.select(remaining):
                    if key.fd == exit_fd:
                        exited = True
                        selector.unregister(exit_fd)
                        # Children left running would hold the pipes open: end them now.
                        _kill_group(proc.pid)
                        deadline = min(deadline, time.monotonic() + PIPE_DRAIN_GRACE_S)
                    elif chunk := os.read(key.fd, READ_CHUNK_BYTES):
                        outputs[key.fd].append(chunk)
                    else:
                        selector.unregister(key.fd)
            if not exited:  # the pipes closed early, or the deadline passed
                ready = selector.select(max(0.0, deadline - time.monotonic()))
                exited = any(key.fd == exit_fd for key, _ in ready)
        # The leader is not reaped yet (a zombie at worst), so its pid is still the group id
        # and cannot have been reused: killing the group reaches only what the program started.
        _kill_group(proc.pid)
        proc.wait()
        return ExecResult(
            stdout=stdout.text(),
            stderr=stderr.text(),
            exit_code=proc.returncode,
            duration_s=time.monotonic() - started,
            timed_out=not exited,
            truncated=stdout.dropped > 0 or stderr.dropped > 0,
            fault="" if exited else FAULT_TIMEOUT,
        )

    def _launcher(self, timeout_s: float) -> list[str]:
        limits = {
            "RLIMIT_CPU": math.ceil(timeout_s) + CPU_LIMIT_MARGIN_S,
            "RLIMIT_AS": self.limits.memory_bytes,
            "RLIMIT_FSIZE": self.limits.file_bytes,
            "RLIMIT_NPROC": self.limits.processes,
            "RLIMIT_NOFILE": self.limits.open_files,
            "RLIMIT_CORE": 0,
        }
        spec = ",".join(f"{name}={value}" for name, value in limits.items())
        # -I -S: the launcher ignores PYTHON* variables and site-packages, and starts fast.
        return [self.python, "-I", "-S", "-c", _LAUNCHER, spec]

    def _isolation_prefix(self) -> list[str]:
        if self.bwrap is None:
            return []
        # The interpreter's installation (a venv: two levels up) stays visible when it
        # lives under /tmp, which the sandbox replaces with an empty tmpfs.
        prefix = Path(self.python).absolute().parent.parent
        return bwrap_argv(self.bwrap, self.work_dir, keep=[prefix])

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


def bwrap_argv(bwrap: str, work_dir: Path, keep: list[Path] | None = None) -> list[str]:
    """The bubblewrap prefix: read-only root filesystem, a private /tmp, only the work dir
    writable, fresh namespaces (no network), and death with the parent. `keep`: paths
    under /tmp that stay visible, read-only (the interpreter's installation)."""
    kept = [path for path in keep or [] if path.is_relative_to("/tmp")]
    return [
        bwrap,
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        *[arg for path in kept for arg in ("--ro-bind", str(path), str(path))],
        "--bind", str(work_dir), str(work_dir),
        "--chdir", str(work_dir),
        "--unshare-all",
        "--die-with-parent",
        "--",
    ]  # fmt: skip


@contextlib.contextmanager
def _pidfd(pid: int) -> Iterator[int]:
    """A descriptor that becomes readable when `pid` exits (Linux >= 5.3)."""
    fd = os.pidfd_open(pid)
    try:
        yield fd
    finally:
        os.close(fd)


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
