"""Every process a role starts ends when the role's main process does, however it dies.

    run_role ──Lifeline.start()──▶ python -m agentjet.lifeline   (the watcher: own session,
        │                          stdlib only; polls getppid() every POLL_S)
        ├── AGENTJET_LIFELINE=<token> in os.environ: every program the role starts from now
        │   on inherits it (p2pd, the coordinator's beacon and its DHT, sandbox programs)
        ├── the write end of the watcher's stdin pipe: every process the role forks inherits
        │   it (hivemind's DHT process and averagers)
        ├── on that pipe, each cleanup a layer above registered (`on_unclean_end`)
        └── at a clean end, after its own cleanup: "clean" on that pipe

    role gone ──▶ watcher: SIGTERM every process marked either way, SIGKILL what is left
                  after TERM_GRACE_S (and any it started meanwhile), run the registered
                  cleanups (not after a clean end: the role did), exit.

Two marks because /proc/PID/environ shows the environment a process was *exec*'d with: a
variable set now is seen in the programs started after, never in a forked child (the role
was exec'd without it). Forked children hold the role's open files instead, and the pipe
is one only this role's family holds. The watcher watches its parent's pid rather than
using PR_SET_PDEATHSIG: that signal follows the thread that started it, not the process.

What is left outside the process table is the layers' business: sandboxes/docker_sandbox.py
registers "remove this process's sandbox containers" (`on_unclean_end`), and the watcher
calls that function by its name. This module imports nothing of the packages above it.

Also the /proc helpers the launcher uses to find and reap what it started (by PID, never
by name), and `watch_children`: a role whose helper process died (the OOM killer takes
the largest) stops with one clear error instead of waiting forever for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from agentjet.errors import AgentjetError

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)

ENV = "AGENTJET_LIFELINE"
# How often the watcher checks that the role still runs.
POLL_S = 0.2
# How long a role waits for its watcher to start (Python start-up).
START_TIMEOUT_S = 30.0
# Once the role is gone, its processes get SIGTERM (p2pd removes its socket, helpers
# clean up), then SIGKILL after this long.
TERM_GRACE_S = 2.0
# Bound on the whole hunt, SIGKILL rounds included.
END_TIMEOUT_S = 10.0
# How often `watch_children` checks on the processes it watches.
CHILD_POLL_S = 1.0
# A role whose helper process died has this long for its cleanup, then exits anyway.
CLEANUP_AFTER_CHILD_DEATH_S = 15.0
_CLEAN = b"clean\n"
_READY = b"ready\n"
# A registered cleanup, on the watcher's pipe: this word, a space, a JSON list, a newline.
_CLEANUP = b"cleanup"


class ChildProcessDied(AgentjetError):
    """A helper process a role depends on (a hivemind averager, its DHT) is gone."""


# ── /proc ────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class ProcInfo:
    state: str
    ppid: int
    pgid: int
    start_time: int  # clock ticks after boot: with the pid, names one process for good


def parse_stat(stat: str) -> ProcInfo:
    """/proc/PID/stat's fields; the command name (2nd) may hold spaces and parentheses."""
    fields = stat.rsplit(")", 1)[1].split()
    return ProcInfo(fields[0], int(fields[1]), int(fields[2]), int(fields[19]))


def pids() -> Iterator[int]:
    """Every process's pid (thread-group leaders: threads are not listed)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def proc_info(pid: int) -> ProcInfo | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_stat(f.read())
    except (OSError, IndexError, ValueError):  # gone (or going) meanwhile
        return None


def process_table() -> dict[int, ProcInfo]:
    """Every process's state, parent, process group and start time, read from /proc."""
    table = {}
    for pid in pids():
        info = proc_info(pid)
        if info is not None:
            table[pid] = info
    return table


def descendants(pid: int, table: Mapping[int, ProcInfo] | None = None) -> set[int]:
    """PIDs of every live process below `pid` (found by PID, never matched by name)."""
    children: dict[int, list[int]] = {}
    for child, info in (process_table() if table is None else table).items():
        children.setdefault(info.ppid, []).append(child)
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie has exited)."""
    info = proc_info(pid)
    return info is not None and info.state != "Z"


def owner_token(pid: int) -> str:
    """ "<pid>:<start time>": names one process even after its pid is reused; "" if gone.
    Docker sandbox containers carry their creator's (sandboxes/docker_sandbox.py)."""
    info = proc_info(pid)
    return f"{pid}:{info.start_time}" if info is not None else ""


def holds_mark(environ: bytes, fd_links: Iterable[str], token: str, pipe_inode: int) -> bool:
    """Whether a process with this exec-time environment ("K=V\\0" entries) and these open
    files (readlink of /proc/PID/fd/*) belongs to the role that made `token` and whose
    watcher reads the pipe `pipe_inode`."""
    if f"{ENV}={token}".encode() in environ.split(b"\0"):
        return True
    pipe = f"pipe:[{pipe_inode}]"
    return any(link == pipe for link in fd_links)


def _fd_links(pid: int) -> Iterator[str]:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        with contextlib.suppress(OSError):
            yield os.readlink(f"/proc/{pid}/fd/{fd}")


def marked(pid: int, token: str, pipe_inode: int) -> bool:
    """Whether `pid` is one of the role's (see `holds_mark`); False if it is gone, or not
    ours to read (another user's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return False
    return holds_mark(environ, _fd_links(pid), token, pipe_inode)


def marked_processes(token: str, pipe_inode: int, spare: Iterable[int] = ()) -> set[int]:
    """Live processes that carry the role's mark, but for `spare` (the watcher)."""
    skip = set(spare)
    return {pid for pid in pids() if pid not in skip and marked(pid, token, pipe_inode)}


# ── the role's side ──────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Cleanup:
    """What a role's watcher does once the role died without its own cleanup: import
    `function` ("package.module:name") and call it with `argument`; it returns how many
    `what` ("sandbox containers") it removed. By name, so the layer that registers it is
    imported by the watcher alone, never by this module."""

    function: str
    argument: str
    what: str

    def line(self) -> bytes:
        return _CLEANUP + b" " + json.dumps([self.function, self.argument, self.what]).encode()

    @classmethod
    def parse(cls, line: bytes) -> Cleanup | None:
        word, _, rest = line.partition(b" ")
        if word != _CLEANUP:
            return None
        try:
            function, argument, what = json.loads(rest)
        except (ValueError, TypeError):
            return None
        return cls(str(function), str(argument), str(what))

    def run(self) -> int:
        """Call the function; a failure (no SDK, no engine, an API error, a bad name) is a
        warning and 0: none of it may crash the watcher."""
        try:
            module, _, name = self.function.partition(":")
            removed = getattr(importlib.import_module(module), name)(self.argument)
            return int(removed)
        except Exception as e:
            log.warning("could not remove the %s of %s: %s", self.what, self.argument, e)
            return 0


# This process's registered cleanups, and its running watcher (if it started one, or
# forked from a process that did) that they go to; _lock orders the writes on its pipe.
_cleanups: list[Cleanup] = []
_running: Lifeline | None = None
_lock = threading.Lock()


def on_unclean_end(function: str, argument: str, what: str) -> None:
    """Have the role's watcher call `function(argument)` (see `Cleanup`) should the role
    die without its own cleanup: how a layer above has what it left outside the process
    table removed (sandboxes/docker_sandbox.py: the containers this process made). Before
    the watcher starts or after: it gets every one; the same one twice runs once."""
    cleanup = Cleanup(function, argument, what)
    with _lock:
        if cleanup in _cleanups:
            return
        _cleanups.append(cleanup)
        if _running is not None:
            _running._send(cleanup.line() + b"\n")


class Lifeline:
    """A role's watcher process, started before the role starts any other (`start`);
    `close()` when the role's own cleanup has run."""

    def __init__(self, process: subprocess.Popen[bytes], previous: str | None) -> None:
        self.process = process
        self._previous = previous

    @classmethod
    def start(cls, name: str) -> Lifeline | None:
        """Start the watcher of this process and mark the environment; None (with a
        warning) where that cannot be done: then a crash can leave processes behind."""
        if sys.platform != "linux":
            return None
        token = f"{os.getpid()}-{secrets.token_hex(8)}"
        argv = [sys.executable, "-m", "agentjet.lifeline"]
        argv += [str(os.getpid()), token, name]
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                # A terminal's Ctrl-C and a kill of the role's process group spare it.
                start_new_session=True,
            )
        except OSError as e:
            log.warning("could not start the lifeline watcher (%s); continuing without", e)
            return None
        assert process.stdout is not None
        with process.stdout:
            ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
            line = process.stdout.readline() if ready else b""
        if line != _READY:
            log.warning(
                "the lifeline watcher did not start (%s); continuing without: if this "
                "process is killed, the processes it started keep running",
                f"exit code {process.poll()}" if ready else f"no answer in {START_TIMEOUT_S} s",
            )
            process.kill()
            process.wait()
            return None
        previous = os.environ.get(ENV)
        os.environ[ENV] = token
        lifeline = cls(process, previous)
        lifeline._take_cleanups()
        return lifeline

    def _take_cleanups(self) -> None:
        """This process's watcher from now on: it gets every cleanup registered so far,
        and `on_unclean_end` sends it each one registered later."""
        global _running
        with _lock:
            _running = self
            for cleanup in _cleanups:
                self._send(cleanup.line() + b"\n")

    def close(self) -> None:
        """The role's cleanup has run: its watcher ends whatever is still left once this
        process has exited (without running the registered cleanups), then exits too."""
        global _running
        if self._previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = self._previous
        with _lock:
            if _running is self:
                _running = None
            self._send(_CLEAN)
            stdin: IO[bytes] | None = self.process.stdin
            if stdin is not None and not stdin.closed:
                with contextlib.suppress(OSError):
                    stdin.close()

    def _send(self, message: bytes) -> None:
        """One message on the watcher's pipe (under _lock); none once it is closed."""
        stdin: IO[bytes] | None = self.process.stdin
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError):  # the watcher is gone: nothing to tell
                stdin.write(message)
                stdin.flush()


def mark() -> dict[str, str]:
    """The role's mark, for a program started with an environment of its own instead of
    this process's (a sandbox program): then it too ends with the role."""
    token = os.environ.get(ENV)
    return {ENV: token} if token else {}


# ── a role's helper processes ────────────────────────────────────────────────────────


def exit_reason(exitcode: int) -> str:
    """A process's exit as people read it: "SIGKILL: out of memory?", "exit code 1"."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    return f"{name}: out of memory?" if -exitcode == signal.SIGKILL else name


async def watch_children(
    children: Mapping[str, BaseProcess],
    role: str,
    interval_s: float = CHILD_POLL_S,
    exit_after_s: float | None = None,
) -> None:
    """Run until cancelled; raise ChildProcessDied once one of `children` (a name for
    people, and a process this process started) has exited (and, with `exit_after_s`,
    end this process that long after, should its cleanup hang on the dead child). A role
    loop: a role waiting on a dead helper would wait forever."""
    while True:
        for name, child in children.items():
            code = child.exitcode  # reaps it: only its parent may ask
            if code is not None:
                error = ChildProcessDied(
                    f"{name} process {child.pid} died ({exit_reason(code)}); the {role} stops"
                )
                if exit_after_s is not None:
                    exit_after(exit_after_s, error)
                raise error
        await asyncio.sleep(interval_s)


def exit_after(seconds: float, error: Exception) -> None:
    """End this process with `error` in `seconds` unless it has ended by then. Its cleanup
    may wait on the dead helper forever (a step in a worker thread holds the step lock;
    hivemind's shutdown asks the dead averager): the watcher then ends what is left."""

    def end() -> None:
        print(
            f"agentjet: error: {error} (cleanup did not finish in {seconds:g} s)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()


# ── the watcher ──────────────────────────────────────────────────────────────────────


@dataclass
class Messages:
    """What the role said on the watcher's pipe, read as it comes (a line at a time)."""

    clean: bool = False
    cleanups: list[Cleanup] = field(default_factory=list)
    _partial: bytes = b""

    def feed(self, data: bytes) -> None:
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            if line == _CLEAN.rstrip():
                self.clean = True
            elif (cleanup := Cleanup.parse(line)) is not None and cleanup not in self.cleanups:
                self.cleanups.append(cleanup)


def _wait_for_role(role_pid: int) -> Messages:
    """Until the role process is gone (this process is then someone else's child); returns
    what it said: whether its cleanup had run, the cleanups it registered."""
    messages = Messages()
    reading = True
    while os.getppid() == role_pid:
        if not reading:
            time.sleep(POLL_S)  # the pipe is closed: only the parent's pid tells
            continue
        ready, _, _ = select.select([0], [], [], POLL_S)
        if ready:
            data = os.read(0, 4096)
            messages.feed(data)
            reading = bool(data)
    while reading and select.select([0], [], [], 0)[0]:  # what it wrote just before it went
        data = os.read(0, 4096)
        messages.feed(data)
        reading = bool(data)
    return messages


def _signal_marked(
    sig: signal.Signals, token: str, pipe_inode: int, spare: set[int], timeout_s: float
) -> set[int]:
    """Send `sig` to every marked process and wait (at most `timeout_s`) for them to exit;
    returns the pids signalled. Each is held by a pidfd and checked again through it, so a
    pid reused meanwhile is never signalled."""
    held: dict[int, int] = {}
    try:
        for pid in marked_processes(token, pipe_inode, spare):
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue  # gone meanwhile
            try:
                if not marked(pid, token, pipe_inode):
                    raise ProcessLookupError  # it exited, and the pid is another's now
                signal.pidfd_send_signal(fd, sig)
            except OSError:  # gone, or not ours to signal (a setuid program)
                os.close(fd)
                continue
            held[pid] = fd
        deadline = time.monotonic() + timeout_s
        waiting = set(held.values())
        while waiting and (left := deadline - time.monotonic()) > 0:
            exited, _, _ = select.select(list(waiting), [], [], left)  # readable: it exited
            waiting -= set(exited)
        return set(held)
    finally:
        for fd in held.values():
            os.close(fd)


def end_marked(token: str, pipe_inode: int, spare: set[int]) -> set[int]:
    """End every process of the role: SIGTERM, then SIGKILL (repeated until none is found,
    as one may have started another meanwhile, within END_TIMEOUT_S); the pids ended."""
    deadline = time.monotonic() + END_TIMEOUT_S
    ended = _signal_marked(signal.SIGTERM, token, pipe_inode, spare, TERM_GRACE_S)
    while time.monotonic() < deadline:
        killed = _signal_marked(
            signal.SIGKILL, token, pipe_inode, spare, deadline - time.monotonic()
        )
        if not killed:
            break
        ended |= killed
    return ended


def run_cleanups(cleanups: Iterable[Cleanup], name: str) -> None:
    """The cleanups a role registered, in order, after it died without its own; each
    failure is a warning (what is left, the layer's next start removes: the next docker
    sandbox pool on this host, `DockerEngine.reap_orphans`)."""
    for cleanup in cleanups:
        removed = cleanup.run()
        if removed:
            log.warning("removed %d %s of the %s", removed, cleanup.what, name)


def watch(role_pid: int, token: str, name: str) -> int:
    """The watcher process: see the module docstring."""
    pipe_inode = os.fstat(0).st_ino
    os.write(1, _READY)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nobody reads our stdout any more
    os.close(devnull)
    messages = _wait_for_role(role_pid)
    clean = messages.clean
    ended = end_marked(token, pipe_inode, spare={os.getpid()})
    if ended:
        why = "left running after its clean stop" if clean else "it started"
        log.warning(
            "the %s (pid %d) is gone; ended %d processes %s: %s",
            name,
            role_pid,
            len(ended),
            why,
            " ".join(map(str, sorted(ended))),
        )
    if not clean:
        run_cleanups(messages.cleanups, name)
    return 0


def main(argv: list[str]) -> int:
    role_pid, token, name = argv
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} lifeline %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    return watch(int(role_pid), token, name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
