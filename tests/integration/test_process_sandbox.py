"""ProcessSandbox: what a hostile or broken program can and cannot do to its caller."""

from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.base import SandboxError
from sandboxes.process import ProcessSandbox, ResourceLimits
from tests import procs

pytestmark = pytest.mark.integration

# Generous for a run that should end at once, small next to the timeouts tested.
QUICK_S = 10.0
# Timeout for programs that never end by themselves.
SHORT_TIMEOUT_S = 0.5
# How long a killed process may take to disappear from /proc.
REAP_WAIT_S = 5.0
# Address-space limit for the memory tests: far below what the hogs ask for.
SMALL_MEMORY_BYTES = 256 << 20


@pytest.fixture
def box() -> Iterator[ProcessSandbox]:
    with ProcessSandbox(limits=ResourceLimits(memory_bytes=SMALL_MEMORY_BYTES)) as sandbox:
        yield sandbox


def _running_with(marker: str) -> list[int]:
    """Pids of live processes whose command line holds `marker` (zombies count as gone).

    Found by a marker, not by the pid the program reports, because under bubblewrap that
    pid belongs to the sandbox's own pid namespace.
    """
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():  # self, thread-self and kernel files
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            continue
        if marker.encode() in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def _none_running_within(marker: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while _running_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _spawn_sleeper(marker: str) -> str:
    """Code that starts a child sleeping forever, tagged with `marker` in its argv."""
    return (
        "import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)', "
        f"{marker!r}])\n"
    )


def test_python_output_and_exit_codes(box: ProcessSandbox) -> None:
    result = box.exec("print('hello')", QUICK_S)
    assert (result.stdout, result.stderr, result.exit_code) == ("hello\n", "", 0)
    assert result.ok and not result.timed_out and not result.truncated
    assert box.exec("import sys; sys.exit(7)", QUICK_S).exit_code == 7
    crashed = box.exec("raise ValueError('bad input')", QUICK_S)
    assert crashed.exit_code == 1 and not crashed.ok
    assert "ValueError: bad input" in crashed.stderr


def test_shell_command(box: ProcessSandbox) -> None:
    result = box.exec("echo hi; echo oops >&2; exit 3", QUICK_S, language="sh")
    assert (result.stdout, result.stderr, result.exit_code) == ("hi\n", "oops\n", 3)


def test_timeout_kills_the_program_and_its_children(box: ProcessSandbox) -> None:
    marker = f"agentjet-test-{uuid.uuid4()}"
    code = _spawn_sleeper(marker) + "while True:\n    pass\n"
    result = box.exec(code, SHORT_TIMEOUT_S)
    assert result.timed_out and result.exit_code == -9
    assert SHORT_TIMEOUT_S <= result.duration_s < QUICK_S
    assert _none_running_within(marker, REAP_WAIT_S)


def test_children_left_behind_after_a_normal_exit_are_killed(box: ProcessSandbox) -> None:
    marker = f"agentjet-test-{uuid.uuid4()}"
    code = _spawn_sleeper(marker) + "import time; time.sleep(0.2)\n"
    assert box.exec(code, QUICK_S).ok
    assert _none_running_within(marker, REAP_WAIT_S)


def test_closed_pipes_do_not_hide_a_running_program(box: ProcessSandbox) -> None:
    result = box.exec("import os, time; os.close(1); os.close(2); time.sleep(1000)", 0.3)
    assert result.timed_out


def test_memory_hog_is_stopped(box: ProcessSandbox) -> None:
    at_once = box.exec("data = bytearray(1 << 30)", QUICK_S)
    assert at_once.exit_code != 0 and "MemoryError" in at_once.stderr
    growing = box.exec("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))", QUICK_S)
    assert growing.exit_code != 0 and "MemoryError" in growing.stderr


def test_output_is_truncated() -> None:
    with ProcessSandbox(max_output_bytes=1000) as box:
        once = box.exec("print('x' * 100_000)", QUICK_S)
        assert once.ok and once.truncated and once.stdout == "x" * 1000
        flood = box.exec("while True:\n    print('y' * 1000)", SHORT_TIMEOUT_S)
        assert flood.timed_out and flood.truncated and len(flood.stdout) == 1000


def test_files_round_trip_between_caller_and_program(box: ProcessSandbox) -> None:
    box.put_file("data/in.txt", b"41")
    code = "n = int(open('data/in.txt').read())\nopen('out.txt', 'w').write(str(n + 1))"
    assert box.exec(code, QUICK_S).ok
    assert box.get_file("out.txt") == b"42"


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/hostname", "", "."])
def test_file_paths_must_stay_inside_the_work_dir(box: ProcessSandbox, path: str) -> None:
    with pytest.raises(SandboxError):
        box.get_file(path)
    with pytest.raises(SandboxError):
        box.put_file(path, b"x")


def test_a_planted_symlink_cannot_reach_the_host(box: ProcessSandbox) -> None:
    assert box.exec("import os; os.symlink('/etc/hostname', 'link')", QUICK_S).ok
    with pytest.raises(SandboxError):
        box.get_file("link")


def test_a_work_dir_swapped_for_a_link_is_not_followed(tmp_path: Path) -> None:
    # Without bubblewrap the program can write the work dir's parent (under bwrap it cannot).
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_bytes(b"keep")
    swap = (
        "import os\nwork = os.path.basename(os.getcwd())\nos.chdir('..')\n"
        f"os.rename(work, 'old')\nos.symlink('{victim}', work)"
    )
    with ProcessSandbox(use_bwrap=False) as box:
        assert box.exec(swap, QUICK_S).ok
        with pytest.raises(SandboxError, match="link"):
            box.put_file("precious.txt", b"overwritten")
        box.reset()
        assert (victim / "precious.txt").read_bytes() == b"keep"
        assert box.exec("import os; print(os.listdir('.'))", QUICK_S).stdout == "[]\n"


def test_missing_file_is_a_sandbox_error(box: ProcessSandbox) -> None:
    with pytest.raises(SandboxError, match="nope.txt"):
        box.get_file("nope.txt")


def test_reset_wipes_the_work_dir(box: ProcessSandbox) -> None:
    box.put_file("keep.txt", b"1")
    # A read-only directory must not stop the wipe.
    assert box.exec("import os; os.mkdir('ro'); open('ro/f', 'w'); os.chmod('ro', 0o500)", 5).ok
    box.reset()
    assert box.exec("import os; print(os.listdir('.'))", QUICK_S).stdout == "[]\n"
    with pytest.raises(SandboxError):
        box.get_file("keep.txt")


def test_parent_environment_is_not_leaked(
    box: ProcessSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTJET_TEST_SECRET", "hunter2")
    result = box.exec("import os; print(dict(os.environ))", QUICK_S)
    assert result.ok
    assert "AGENTJET_TEST_SECRET" not in result.stdout and "hunter2" not in result.stdout


def test_program_runs_in_the_work_dir_which_close_removes() -> None:
    box = ProcessSandbox()
    box.start()
    work = box.work_dir
    assert box.exec("import os; print(os.getcwd())", QUICK_S).stdout.strip() == str(work)
    box.close()
    assert not work.exists()
    with pytest.raises(SandboxError, match="start"):
        box.exec("print(1)", QUICK_S)
    box.close()


def test_unrunnable_code_is_a_result_not_an_exception(box: ProcessSandbox) -> None:
    result = box.exec("print('a')\x00", QUICK_S)
    assert result.error and not result.ok


@pytest.mark.skipif(os.geteuid() == 0, reason="Linux does not enforce RLIMIT_NPROC for root")
def test_fork_bomb_is_bounded() -> None:
    # RLIMIT_NPROC counts every task of the user, so allow a few more than exist now. The
    # bomb stops by itself after MAX_FORKS, so a broken limit cannot hurt the machine.
    max_forks = 500
    tasks_now = sum(
        len(os.listdir(f"/proc/{pid}/task"))
        for pid in os.listdir("/proc")
        if pid.isdigit() and _owned_by_me(pid)
    )
    code = (
        "import os, time\n"
        "forks = 0\n"
        f"while forks < {max_forks}:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "    except BlockingIOError:\n"
        "        break\n"
        "    forks += 1\n"
        "print(forks)\n"
    )
    with ProcessSandbox(limits=ResourceLimits(processes=tasks_now + 32)) as box:
        result = box.exec(code, QUICK_S)
    assert result.ok
    assert int(result.stdout) < max_forks


def _owned_by_me(pid: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_bwrap_keeps_the_host_read_only_and_offline() -> None:
    code = (
        "import socket\n"
        "open('ok.txt', 'w').write('x')\n"
        "try:\n"
        "    open('/usr/agentjet-test', 'w')\n"
        "except OSError:\n"
        "    print('read-only')\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
        "except OSError:\n"
        "    print('offline')\n"
    )
    with ProcessSandbox(use_bwrap=True) as box:
        result = box.exec(code, QUICK_S)
        assert result.stdout.split() == ["read-only", "offline"]
        assert box.get_file("ok.txt") == b"x"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_an_interpreter_installed_under_tmp_still_runs_under_bwrap(tmp_path: Path) -> None:
    # bwrap gives the program an empty /tmp; a checkout (and its venv) may live there.
    venv = tmp_path / "venv"
    procs.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (tmp_path / "secret.txt").write_text("host only")
    with ProcessSandbox(python=str(venv / "bin" / "python"), use_bwrap=True) as box:
        result = box.exec(f"import os, sys; print(sys.prefix, os.listdir('{tmp_path}'))", QUICK_S)
    assert result.ok, result.stderr
    assert result.stdout == f"{venv} ['venv']\n"  # the rest of the host's /tmp stays hidden
