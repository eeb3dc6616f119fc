"""Processes in tests: started so that they die with the test run, kept out of the unit
tier, and read from the process table by PID (never matched by name).

Every process a test starts goes through `popen` or `run` (subprocess.Popen's and
subprocess.run's arguments). The child asks the kernel for SIGKILL when its parent goes
(prctl PR_SET_PDEATHSIG, `die_with_parent`), so a pytest that is SIGKILLed or SIGTERMed,
and so runs no fixture's teardown, takes its children with it. A role started so ends what
it started itself (its lifeline watcher, agentjet/lifeline.py). Processes the test process
forks (hivemind's DHT and averagers of an optimizer a test makes in-process, a
multiprocessing child) get the same signal from `die_with_this_process`, which
tests/conftest.py installs; a spawned multiprocessing child calls `die_with_parent` itself
(tests/swarm_peer.py).

The signal follows the *thread* that started the child, not the process: a child started
from a thread that ends is killed then. Start children from the test's main thread (where
pytest runs the test and an asyncio test's loop runs) or from a thread that outlives them;
a fork from any other thread is left without the signal (`die_with_this_process`).

`ProcessesForbidden` is the unit tier's guard (tests/conftest.py): while it is entered,
starting a process fails the test.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import ctypes
import functools
import multiprocessing.process
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


def command_line(pid: int) -> str:
    """`pid`'s command line, its arguments joined by spaces ("" once it is gone)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def children(pid: int) -> set[int]:
    """The pids of `pid`'s child processes (those of every thread of it)."""
    found: set[int] = set()
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            found.update(map(int, listing.read_text().split()))
    return found


def die_with_parent(parent_pid: int) -> None:
    """In a child: have the kernel SIGKILL this process when its parent (the thread that
    started it) ends; at once if `parent_pid` has already gone."""
    if _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent_pid:  # it went before the prctl
        os.kill(os.getpid(), signal.SIGKILL)


def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """subprocess.Popen(argv, **kwargs), the child killed when this process ends."""
    if "preexec_fn" in kwargs:
        raise TypeError("popen sets preexec_fn itself (die_with_parent)")
    return subprocess.Popen(
        argv, preexec_fn=functools.partial(die_with_parent, os.getpid()), **kwargs
    )


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """subprocess.run(argv, **kwargs), the child killed when this process ends."""
    if "preexec_fn" in kwargs:
        raise TypeError("run sets preexec_fn itself (die_with_parent)")
    return subprocess.run(
        argv, preexec_fn=functools.partial(die_with_parent, os.getpid()), **kwargs
    )


# Set in the parent just before each fork, read in the child: (parent pid, whether the
# forking thread is the parent's main thread). The forking thread holds the GIL between.
_forking: tuple[int, bool] = (0, False)
_installed = False


def _note_fork() -> None:
    global _forking
    _forking = (os.getpid(), threading.current_thread() is threading.main_thread())


def _die_with_forker() -> None:
    parent_pid, from_main_thread = _forking
    if from_main_thread:
        die_with_parent(parent_pid)


def die_with_this_process() -> None:
    """Have every child this process forks from its main thread from now on (os.fork,
    multiprocessing's fork) die when it does; once per process."""
    global _installed
    if not _installed:
        os.register_at_fork(before=_note_fork, after_in_child=_die_with_forker)
        _installed = True


class ProcessesForbidden:
    """While entered, every way of starting a process from Python (subprocess, os.fork and
    its kin, posix_spawn, multiprocessing, os.system) fails the test at once, saying `rule`;
    `attempts` lists what was tried (for a test that went on after catching the failure).
    A process started from C (torch starts torch_shm_manager so) shows in `left_running`."""

    def __init__(self, rule: str) -> None:
        self.rule = rule
        self.attempts: list[str] = []
        self._restore = contextlib.ExitStack()
        self._before: set[int] = set()

    def left_running(self) -> list[str]:
        """The child processes of this process started since `__enter__` and still running,
        each as "pid (command line)"."""
        started = children(os.getpid()) - self._before
        return [f"{pid} ({command_line(pid)})" for pid in sorted(started) if alive(pid)]

    def __enter__(self) -> ProcessesForbidden:
        self._before = children(os.getpid())
        targets: list[tuple[Any, str, str]] = [
            (subprocess, "_fork_exec", "subprocess.Popen"),  # its own binding of fork_exec
            (_posixsubprocess, "fork_exec", "_posixsubprocess.fork_exec"),  # multiprocessing
            (os, "fork", "os.fork"),
            (os, "forkpty", "os.forkpty"),
            (os, "posix_spawn", "os.posix_spawn"),  # subprocess.Popen's other way
            (os, "posix_spawnp", "os.posix_spawnp"),
            (os, "system", "os.system"),
            (multiprocessing.process.BaseProcess, "start", "multiprocessing's Process.start"),
        ]
        for owner, name, label in targets:
            if hasattr(owner, name):
                self._restore.callback(setattr, owner, name, getattr(owner, name))
                setattr(owner, name, self._refuse(label))
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore.close()

    def _refuse(self, what: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            self.attempts.append(what)
            pytest.fail(f"{what}: this test tried to start a process; {self.rule}")

        return refuse
