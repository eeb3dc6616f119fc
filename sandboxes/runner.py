"""The sandbox runner: one warm interpreter per sandbox, forking a child for each program.

    host (ProcessSandbox, DockerSandbox)                 inside the sandbox
    RunnerLink.request(header, blob) ── frame ──▶  serve(): fork ──▶ child: own session,
                                                   │                 rlimits, env, cwd, then
                                                   │                 the Python program run in
                                                   │                 the warm interpreter (or
                                                   │                 /bin/sh exec'd)
               ◀── "o"/"e" output, "d" data, "r" result ── reads the child's pipes, kills its
                                                   group at the deadline, reaps it

A fresh `python -c` per program costs 20-40 ms of interpreter start-up (more under bwrap or
`docker exec`); a fork of an interpreter that has already started costs about one. The
runner is started once per sandbox (the process backend: as a subprocess, under bwrap when
installed; docker: as the container's PID 1, talking over its attached stdin and stdout)
and survives `reset`.

What a program sees is what `python -c CODE` shows it: `__main__` fresh, `sys.argv ==
["-c"]`, the work dir first on `sys.path`, unbuffered output, its own environment and
limits, tracebacks of its own frames only, atexit handlers and non-daemon threads run at
exit. It cannot reach the runner's channel: its stdin is /dev/null, its stdout and stderr
are fresh pipes, every other descriptor is closed, and the runner is not dumpable (no
ptrace, no /proc/PID/fd of it to a program without CAP_SYS_PTRACE). A program that kills
the runner ends its own run: the host reports the sandbox lost and starts a new runner.

Frames. Host to runner: `!II` (header length, blob length), a JSON header, the blob.
Runner to host: `!cI` (kind, length), then the payload: kind "o" and "e" carry program
output, "d" a file's bytes, and every request ends with exactly one "r": its JSON result.

This file is the runner's whole program (stdlib only: the docker image has python3 and
nothing else) and the host's end of the protocol; the host sends its source as `-c`.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import errno
import json
import os
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

# After the program exits, output still buffered in its pipes is read for at most this
# long; only a process that escaped the group (setsid) can hold a pipe open past it.
PIPE_DRAIN_GRACE_S = 0.5
# One read from a pipe; the kernel's pipe buffer is 64 KiB.
READ_CHUNK_BYTES = 64 * 1024
# Largest request the runner accepts: a put_file blob and its header.
MAX_REQUEST_BYTES = 64 << 20
REQUEST = struct.Struct("!II")
# prctl(2) and capset(2) constants (linux/prctl.h, linux/capability.h, linux/securebits.h).
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# NOROOT, NO_SETUID_FIXUP and KEEP_CAPS off, each locked: root gains nothing on exec.
SECURE_NOROOT_LOCKED = 0b101111
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
FRAME = struct.Struct("!cI")

# ── the runner (inside the sandbox) ─────────────────────────────────────────────────────


def serve() -> None:
    """Answer requests on stdin until it closes; nothing of the runner's own goes to stdout."""
    if _libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:  # no ptrace, no /proc/PID/fd of it
        raise OSError("prctl(PR_SET_DUMPABLE) failed")
    # The compiler sets itself up on its first use (~8 ms): once here, not in every child.
    compile("pass", "<string>", "exec")
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select below
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    handlers = {"exec": _exec, "write": _write, "read": _read, "reset": _reset, "text": _text}
    while True:
        _reap_orphans()
        try:
            header, blob = _read_request()
        except EOFError:
            return
        handler = handlers.get(header.get("op", ""))
        if handler is None:
            _send(b"r", json.dumps({"error": f"unknown op {header.get('op')!r}"}).encode())
            continue
        try:
            result = handler(header, blob, wake_r)
        except Exception as e:  # the runner stays up; the host sees one clear error
            result = {"error": f"{type(e).__name__}: {e}"}
        _send(b"r", json.dumps(result).encode())


def _exec(header: dict, blob: bytes, wake_r: int) -> dict:
    """Run one program: fork, collect its output until it exits or the deadline passes."""
    started = time.monotonic()
    deadline = started + float(header["timeout_s"])
    keep = int(header["max_output"])
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
    except OSError:  # EAGAIN: the pids limit, say
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)
        raise
    if pid == 0:  # pragma: no cover - the child ends in os._exit or exec
        _child(header, blob.decode("utf-8", errors="surrogateescape"), out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    kinds = {out_r: b"o", err_r: b"e"}
    sent, dropped = dict.fromkeys(kinds, 0), dict.fromkeys(kinds, 0)
    watched = [out_r, err_r, wake_r]
    exited = _exited(pid)
    try:
        while (len(watched) > 1 or not exited) and (remaining := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(watched, [], [], remaining)
            for fd in ready:
                if fd == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                    continue
                chunk = os.read(fd, READ_CHUNK_BYTES)
                if not chunk:
                    watched.remove(fd)
                    continue
                room = max(0, keep - sent[fd])
                if room:
                    _send(kinds[fd], chunk[:room])
                sent[fd] += min(room, len(chunk))
                dropped[fd] += max(0, len(chunk) - room)
            if not exited and _exited(pid):
                exited = True
                # Children left running would hold the pipes open: end them now.
                _kill_group(pid)
                deadline = min(deadline, time.monotonic() + PIPE_DRAIN_GRACE_S)
    finally:
        # The leader is not reaped yet (a zombie at worst), so its pid is still the group id
        # and cannot have been reused: killing the group reaches only what the program started.
        _kill_group(pid)
        _, status = os.waitpid(pid, 0)
        os.close(out_r)
        os.close(err_r)
    return {
        "exit_code": os.waitstatus_to_exitcode(status),
        "timed_out": not exited,
        "dropped": sum(dropped.values()),
        "duration_s": time.monotonic() - started,
    }


def _child(header: dict, code: str, out_w: int, err_w: int) -> None:  # pragma: no cover
    """In the forked child: become the program. Never returns."""
    status = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 1 << 20)
        if os.geteuid() == 0:
            _drop_capabilities()
        for name, value in header.get("limits", {}).items():
            kind = getattr(resource, name)
            hard = resource.getrlimit(kind)[1]
            limit = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
            resource.setrlimit(kind, (limit, limit))
        os.chdir(header["cwd"])
        os.environ.clear()
        os.environ.update(header["env"])
        if header["language"] == "sh":
            # Python ignores these; a shell and its commands get the default (`yes | head`).
            for ignored in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(ignored, signal.SIG_DFL)
            os.execve("/bin/sh", ["/bin/sh", "-c", code], header["env"])
        status = _run_python(code)
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        os._exit(status)


def _drop_capabilities() -> None:  # pragma: no cover - runs in the forked child
    """A program run as root keeps uid 0 but no capability, now or after an exec: with
    CAP_SYS_PTRACE it could reach the runner, and through it the programs after it."""
    libc = _libc()
    for cap in range(64):  # the bounding set, up to the kernel's last capability
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    calls = [
        (PR_SET_SECUREBITS, SECURE_NOROOT_LOCKED),
        (PR_SET_NO_NEW_PRIVS, 1),
        (PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL),
    ]
    for option, value in calls:
        if libc.prctl(option, value, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl({option})")
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    nothing = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; two words each
    if libc.capset(header, nothing) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _run_python(code: str) -> int:  # pragma: no cover - runs in the forked child
    """`python -c code` in this interpreter: the exit status it would have."""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    sys.argv[:] = ["-c"]
    sys.path[0] = ""
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
        status = 0
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException as e:
        # The program's own frames only, as `python -c` prints them (not this function's).
        frames = e.__traceback__.tb_next if e.__traceback__ is not None else None
        traceback.print_exception(type(e), e, frames)
        status = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # wait for non-daemon threads
        atexit._run_exitfuncs()
    except SystemExit as e:
        status = _exit_status(e)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return status


def _exit_status(exit: SystemExit) -> int:
    """The status `sys.exit(code)` gives (a message goes to stderr with status 1)."""
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code & 0xFF
    print(exit.code, file=sys.stderr)
    return 1


def _write(header: dict, blob: bytes, _: int) -> dict:
    """put_file inside a container: write (or append) the blob to the path."""
    path = header["path"]
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "ab" if header.get("append") else "wb") as f:
        f.write(blob)
    return {"error": ""}


def _read(header: dict, _: bytes, __: int) -> dict:
    """get_file inside a container: the first `max` bytes (+1, so the host sees too big)."""
    with open(header["path"], "rb") as f:
        data = f.read(int(header["max"]) + 1)
    _send(b"d", data)
    return {"error": ""}


def _text(header: dict, _: bytes, __: int) -> dict:
    """The contents of the readable files among `paths` (cgroup counters)."""
    found = {}
    for path in header["paths"]:
        with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
            found[path] = f.read()
    return {"error": "", "files": found}


def _reset(header: dict, _: bytes, __: int) -> dict:
    """As PID 1 of a container: kill every other process, then empty the scratch dirs."""
    if os.getpid() != 1:
        return {"error": "reset kills every process: only a container's PID 1 may"}
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)  # from PID 1: everyone but itself
    _reap_orphans()
    left = []
    for top in header["dirs"]:
        for entry in os.listdir(top):
            path = os.path.join(top, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                for parent, dirnames, _files in os.walk(path):
                    for name in dirnames:
                        child = os.path.join(parent, name)
                        if not os.path.islink(child):
                            with contextlib.suppress(OSError):
                                os.chmod(child, 0o700)
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o700)
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        left += os.listdir(top)
    return {"error": f"left after reset: {left[:5]}" if left else ""}


def _exited(pid: int) -> bool:
    """Whether the child exited, without reaping it (its pid stays its group's id)."""
    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
    return os.waitid(os.P_PID, pid, flags) is not None


def _reap_orphans() -> None:
    """Reap exited children: orphans re-parented to the runner as a container's PID 1."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _read_request() -> tuple[dict, bytes]:
    head = _read_exactly(REQUEST.size)
    header_size, blob_size = REQUEST.unpack(head)
    if header_size + blob_size > MAX_REQUEST_BYTES:
        raise EOFError  # not the host's framing: stop rather than guess
    return json.loads(_read_exactly(header_size)), _read_exactly(blob_size)


def _read_exactly(size: int) -> bytes:
    parts, left = [], size
    while left:
        chunk = os.read(0, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _send(kind: bytes, payload: bytes) -> None:
    data = memoryview(FRAME.pack(kind, len(payload)) + payload)
    while data:
        data = data[os.write(1, data) :]


# ── the host's end ──────────────────────────────────────────────────────────────────────


class RunnerGone(Exception):
    """The runner's channel closed, broke, or missed its deadline: the sandbox is lost."""


class RunnerLink:
    """Requests to one runner and their frames back, over any byte channel.

    `send(data)` writes to the runner's stdin; `receive(deadline)` returns the next bytes of
    its stdout (b"" at end of stream) or raises TimeoutError once `deadline` (monotonic)
    has passed. One request at a time: a sandbox serves one caller.
    """

    def __init__(self, send: Callable[[bytes], None], receive: Callable[[float], bytes]) -> None:
        self._send = send
        self._receive = receive
        self._buffer = bytearray()

    def request(
        self,
        header: dict[str, Any],
        blob: bytes = b"",
        deadline: float = float("inf"),
        on_frame: Callable[[bytes, bytes], None] | None = None,
    ) -> dict[str, Any]:
        """Send one request; frames other than the result go to `on_frame(kind, payload)`.
        RunnerGone when the channel fails or `deadline` passes before the result."""
        encoded = json.dumps(header).encode()
        try:
            self._send(REQUEST.pack(len(encoded), len(blob)) + encoded + blob)
            while True:
                kind, payload = self._frame(deadline)
                if kind == b"r":
                    result: dict[str, Any] = json.loads(payload)
                    return result
                if on_frame is not None:
                    on_frame(kind, payload)
        except TimeoutError:  # before OSError, its base class
            raise RunnerGone("the sandbox runner stopped answering") from None
        except (OSError, ValueError) as e:
            raise RunnerGone(f"the sandbox runner's channel failed: {e!r}") from None

    def _frame(self, deadline: float) -> tuple[bytes, bytes]:
        kind, size = FRAME.unpack(self._take(FRAME.size, deadline))
        return kind, self._take(size, deadline)

    def _take(self, size: int, deadline: float) -> bytes:
        while len(self._buffer) < size:
            chunk = self._receive(deadline)
            if not chunk:
                raise RunnerGone("the sandbox runner exited")
            self._buffer += chunk
        taken = bytes(self._buffer[:size])
        del self._buffer[:size]
        return taken


def program_bytes(code: str) -> bytes:
    """A program's source as the runner takes it; ValueError (one line) for source no
    interpreter could take: a NUL byte, or text that is not valid Unicode (a lone
    surrogate, which a hostile JSON request can carry)."""
    if "\x00" in code:
        raise ValueError("embedded null byte")
    try:
        return code.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"the source is not valid Unicode ({e.reason} at {e.start})") from None


def pipe_link(process: subprocess.Popen[bytes]) -> RunnerLink:
    """The link to a runner started as `process` with stdin and stdout pipes."""
    assert process.stdin is not None and process.stdout is not None
    stdin, out = process.stdin, process.stdout.fileno()

    def send(data: bytes) -> None:
        stdin.write(data)
        stdin.flush()

    def receive(deadline: float) -> bytes:
        wait_readable(out, deadline)
        return os.read(out, 1 << 16)

    return RunnerLink(send, receive)


def source() -> str:
    """This file's text: the runner's program, sent as `python -c`."""
    return Path(__file__).read_text(encoding="utf-8")


def wait_readable(fd: int, deadline: float) -> None:
    """Block until `fd` is readable; TimeoutError once `deadline` (monotonic) has passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not select.select([fd], [], [], min(remaining, 1e6))[0]:
        raise TimeoutError


if __name__ == "__main__":
    serve()
