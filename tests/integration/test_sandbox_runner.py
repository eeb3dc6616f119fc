"""The sandbox runner (sandboxes/runner.py): a program run by forking a warm interpreter
sees what `python -c` would show it, leaves nothing behind for the next program, and
cannot break its sandbox's channel; the protocol survives a broken or silent runner.

The docker backend runs the same runner as its container's PID 1
(tests/integration/test_docker_sandbox.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes import runner
from sandboxes.base import FAULT_LOST, FAULT_TIMEOUT, SandboxError
from sandboxes.process import ProcessSandbox
from tests import procs

pytestmark = pytest.mark.integration

QUICK_S = 10.0
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed")


@pytest.fixture
def box() -> Iterator[ProcessSandbox]:
    with ProcessSandbox() as sandbox:
        yield sandbox


def test_a_program_sees_what_python_dash_c_shows_it(box: ProcessSandbox) -> None:
    code = (
        "import sys\n"
        "main = sys.modules['__main__'].__dict__ is globals()\n"
        "print(__name__, sys.argv, repr(sys.path[0]), main)\n"
    )
    assert box.exec(code, QUICK_S).stdout == "__main__ ['-c'] '' True\n"
    # The same program under a fresh interpreter prints the same traceback, its own frames only.
    failing = "def f():\n    1/0\nf()\n"
    fresh = procs.run([sys.executable, "-c", failing], capture_output=True, text=True)
    result = box.exec(failing, QUICK_S)
    assert (result.exit_code, result.stderr) == (fresh.returncode, fresh.stderr)
    syntax = box.exec("print(", QUICK_S)
    fresh = procs.run([sys.executable, "-c", "print("], capture_output=True, text=True)
    assert (syntax.exit_code, syntax.stderr) == (fresh.returncode, fresh.stderr)


@pytest.mark.parametrize(
    ("code", "exit_code", "stderr"),
    [
        ("import sys; sys.exit()", 0, ""),
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit('bye')", 1, "bye\n"),
        ("import os; os._exit(7)", 7, ""),
        ("raise KeyboardInterrupt", 1, "KeyboardInterrupt"),
    ],
)
def test_exit_statuses(box: ProcessSandbox, code: str, exit_code: int, stderr: str) -> None:
    result = box.exec(code, QUICK_S)
    assert result.exit_code == exit_code and stderr in result.stderr and not result.fault


def test_a_shell_program_gets_default_signal_handling(box: ProcessSandbox) -> None:
    # The runner is Python, which ignores SIGPIPE; `yes` must still die of it quietly.
    result = box.exec("yes | head -1", QUICK_S, language="sh")
    assert (result.stdout, result.stderr, result.exit_code) == ("y\n", "", 0)


@pytest.mark.parametrize("code", ["print('a')\x00", "print('\ud800')"])
def test_source_no_interpreter_takes_is_a_result(box: ProcessSandbox, code: str) -> None:
    result = box.exec(code, QUICK_S)
    assert result.error.startswith("cannot start the program") and not result.ok
    assert box.exec("print(5)", QUICK_S).stdout == "5\n"


def test_a_runner_that_cannot_start_leaves_nothing_behind(tmp_path: Path) -> None:
    before = set(Path(tempfile.gettempdir()).glob("agentjet-sandbox-*"))
    box = ProcessSandbox(python=str(tmp_path / "no-python"), use_bwrap=False)
    with pytest.raises(SandboxError, match="runner"):
        box.start()
    assert set(Path(tempfile.gettempdir()).glob("agentjet-sandbox-*")) == before


def test_atexit_handlers_and_threads_finish_before_the_run_ends(box: ProcessSandbox) -> None:
    code = (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
        "print('main')\n"
    )
    assert box.exec(code, QUICK_S).stdout.split() == ["main", "thread", "atexit"]


def test_a_program_leaves_nothing_for_the_next(box: ProcessSandbox) -> None:
    poison = (
        "import builtins, os, sys\n"
        "builtins.print = lambda *a, **k: None\n"
        "sys.modules['json'] = None\n"
        "os.environ['POISON'] = '1'\n"
        "x = 42\n"
    )
    assert box.exec(poison, QUICK_S).ok
    after = "import json, os\nprint('x' in globals(), os.environ.get('POISON'), json.dumps(1))\n"
    assert box.exec(after, QUICK_S).stdout == "False None 1\n"


def test_the_runner_survives_reset(box: ProcessSandbox) -> None:
    parent = "import os; print(os.getppid())"
    before = box.exec(parent, QUICK_S).stdout
    box.put_file("f.txt", b"1")
    box.reset()
    assert box.exec(parent, QUICK_S).stdout == before
    assert box.exec("import os; print(os.listdir('.'))", QUICK_S).stdout == "[]\n"


def test_a_program_that_kills_its_runner_loses_only_its_own_run(box: ProcessSandbox) -> None:
    result = box.exec("import os, signal; print('x', flush=True); os.kill(os.getppid(), 9)", 5)
    assert result.fault == FAULT_LOST and "runner" in result.error and not result.ok
    assert not box.healthy()
    after = box.exec("print(2)", QUICK_S)  # a new runner
    assert after.ok and after.stdout == "2\n" and box.healthy()


def test_a_program_that_never_returns_or_floods_gets_the_usual_outcomes(
    box: ProcessSandbox,
) -> None:
    hang = box.exec("import time; time.sleep(100)", 0.5)
    assert hang.timed_out and hang.fault == FAULT_TIMEOUT and hang.exit_code == -9
    flood = box.exec("import sys\nwhile True: sys.stdout.write('x' * 65536)", 1.0)
    assert flood.timed_out and flood.truncated and len(flood.stdout) == runner_keep(box)
    assert box.exec("print(3)", QUICK_S).stdout == "3\n"  # the runner is fine after both


def runner_keep(box: ProcessSandbox) -> int:
    return box.max_output_bytes


@needs_bwrap
def test_a_program_cannot_reach_the_runners_channel() -> None:
    # Every descriptor but 0-2 is closed, stdin is /dev/null, and the runner is not
    # dumpable: its /proc/PID/fd is not the program's to open, nor ptrace.
    code = (
        "import ctypes, os\n"
        "print(os.read(0, 10))\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, b'x')\n"
        "        print('wrote', fd)\n"
        "    except OSError:\n"
        "        pass\n"
        "try:\n"
        "    open(f'/proc/{os.getppid()}/fd/1', 'wb').write(b'forged')\n"
        "    print('opened')\n"
        "except OSError as e:\n"
        "    print('refused')\n"
        "libc = ctypes.CDLL(None)\n"
        "print('ptrace', libc.ptrace(16, os.getppid(), 0, 0))\n"  # PTRACE_ATTACH
    )
    with ProcessSandbox(use_bwrap=True) as box:
        result = box.exec(code, QUICK_S)
        assert result.stdout.split("\n")[:3] == ["b''", "refused", "ptrace -1"], result
        assert box.exec("print(4)", QUICK_S).stdout == "4\n"


# ── the protocol against real runner processes ──────────────────────────────────────────


def start_runner(
    argv: list[str] | None = None,
) -> tuple[subprocess.Popen[bytes], runner.RunnerLink]:
    proc = procs.popen(
        argv or [sys.executable, "-c", runner.source()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    return proc, runner.pipe_link(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def test_a_bad_request_is_one_error_and_the_runner_stays() -> None:
    proc, link = start_runner()
    try:
        assert "unknown op" in link.request({"op": "nope"})["error"]
        assert "KeyError" in link.request({"op": "exec"})["error"]  # fields missing
        # A container's reset kills every process: refused anywhere but as PID 1.
        assert "PID 1" in link.request({"op": "reset", "dirs": []})["error"]
        got: list[bytes] = []
        header = {"op": "read", "path": runner.__file__, "max": 10}
        assert link.request(header, on_frame=lambda kind, data: got.append(kind + data)) == {
            "error": ""
        }
        assert got == [b"d" + runner.source().encode()[:11]]
    finally:
        stop(proc)


def test_an_oversized_request_ends_the_runner_not_the_host() -> None:
    proc, link = start_runner()
    try:
        with pytest.raises(runner.RunnerGone, match="exited"):
            link._send(runner.REQUEST.pack(runner.MAX_REQUEST_BYTES, 1))
            link._frame(time.monotonic() + QUICK_S)
        assert proc.wait(QUICK_S) == 0
    finally:
        stop(proc)


@pytest.mark.parametrize(
    ("script", "match"),
    [
        ("import sys, time; sys.stdin.read(1); time.sleep(100)", "stopped answering"),
        ("import os; os.read(0, 1); os.write(1, b'r\\x00\\x00\\x10\\x00{')", "exited"),
        ("import os; os.read(0, 1); os.write(1, b'r\\x00\\x00\\x00\\x02{]')", "channel failed"),
    ],
)
def test_a_silent_truncated_or_garbled_runner_is_gone_not_a_hang(script: str, match: str) -> None:
    proc, link = start_runner([sys.executable, "-c", script])
    try:
        started = time.monotonic()
        with pytest.raises(runner.RunnerGone, match=match):
            link.request({"op": "text", "paths": []}, deadline=started + 1.0)
        assert time.monotonic() - started < QUICK_S
    finally:
        stop(proc)
