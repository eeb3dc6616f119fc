"""Processes a role started end with it, however it dies (agentjet/lifeline.py).

A stand-in role (tests/lifeline_role.py: a forked child, an exec'd program, a sandbox
program) and a real trainer (hivemind's DHT process, p2pd, two averagers) are SIGKILLed
alone, by their own pid: everything they started must be gone within KILL_DEADLINE_S,
found by PID and by the role's marks, never by name. Every test reaps what it saw by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agentjet.config import load_config, to_toml
from agentjet.lifeline import descendants, marked_processes, running
from tests import procs
from tests.factories import tiny_trainer_settings
from tests.lifeline_role import NOTES
from tests.procs import command_line

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
# The requirement: a role's processes are gone this soon after it died.
KILL_DEADLINE_S = 10.0
# A trainer of the tiny model starts in ~15 s on 2 cores; a loaded machine takes longer.
START_TIMEOUT_S = 120.0
# A trainer whose averager died stops (cleanup included) well within this.
STOP_TIMEOUT_S = 60.0
POLL_S = 0.1


def gone_within(pids: set[int], timeout_s: float) -> set[int]:
    """Wait until none of `pids` runs (a zombie has exited); those still running then."""
    deadline = time.monotonic() + timeout_s
    while (alive := {pid for pid in pids if running(pid)}) and time.monotonic() < deadline:
        time.sleep(POLL_S)  # polling the process table, not standing in for synchronisation
    return alive


def reap(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("end", ["sigkill", "clean"])
def test_what_a_role_started_ends_with_it(tmp_path: Path, end: str):
    """SIGKILLed, or ended cleanly but for three processes its cleanup missed: its watcher
    ends them all (the sandbox program too, though it has an environment of its own and
    a session of its own), runs the cleanups the role registered only if it was killed
    (both: the one registered before the watcher started and the one after), then exits."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the sandbox's work dir
    argv = [sys.executable, "-m", "tests.lifeline_role", *(["clean"] if end == "clean" else [])]
    role = procs.popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    seen: set[int] = set()
    try:
        assert role.stdout is not None
        line = role.stdout.readline()  # the stand-in bounds its own start-up
        seen |= descendants(role.pid)
        assert line, f"the stand-in role printed nothing (exit code {role.poll()})"
        marks = json.loads(line)
        started = {marks[k] for k in ("forked", "started", "sandboxed", "watcher")}
        seen |= started
        assert {pid for pid in started if running(pid)} == started
        assert role.stdin is not None
        if end == "sigkill":
            os.kill(role.pid, signal.SIGKILL)  # the role alone, not its process group
        else:
            role.stdin.write(b"end\n")  # the stand-in ends only once its processes were seen
            role.stdin.flush()
        role.wait(timeout=KILL_DEADLINE_S)

        assert gone_within(started, KILL_DEADLINE_S) == set()
        assert marked_processes(marks["token"], marks["pipe"]) == set()
        cleaned = {note for note in NOTES if (tmp_path / note).exists()}
        assert cleaned == (set(NOTES) if end == "sigkill" else set())
    finally:
        reap(seen | {role.pid})
        role.wait()


@dataclass
class Trainer:
    proc: subprocess.Popen[bytes]
    log_path: Path
    seen: set[int] = field(default_factory=set)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> dict[int, str]:
        """Its live child processes, with their command lines (to tell them apart)."""
        table = descendants(self.proc.pid)
        self.seen |= table
        return {pid: command_line(pid) for pid in table if running(pid)}

    def wait_ready(self) -> dict[int, str]:
        """Wait until it serves, with its lifeline watcher, hivemind's DHT process, p2pd and
        the two averagers running; returns its descendants."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            found = self.children()
            python = [c for c in found.values() if "agentjet_app.cli" in c]
            if (
                " ready: " in self.log()
                and any("agentjet.lifeline" in c for c in found.values())
                and any("p2pd" in c for c in found.values())
                and len(python) >= 3
            ):
                return found
            assert self.proc.poll() is None, f"the trainer exited:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"the trainer did not start:\n{self.log()}"
            time.sleep(POLL_S)  # polling its log and the process table


@pytest.fixture
def trainer(tiny_model_dir: Path, tmp_path: Path, keys_file: Path) -> Iterator[Trainer]:
    """`agentjet node --role trainer` of the tiny model, alone (the first node of a swarm)
    with its averagers started at once, its log (stdout and stderr) in
    tmp_path/trainer.log; everything it started is reaped by PID at the end."""
    socket_dir = Path(tempfile.mkdtemp(prefix="aj-", dir="/tmp"))  # ipc paths must be short
    endpoint = f"ipc://{socket_dir}/trainer.ipc"
    config = load_config(
        None,
        [
            *tiny_trainer_settings(tiny_model_dir, endpoint, keys_file, tmp_path / "run"),
            'swarm.averagers="at_start"',  # alone, it would start them only with a peer
        ],
    )
    config_path = tmp_path / "trainer.toml"
    config_path.write_text(to_toml(config))
    log_path = tmp_path / "trainer.log"
    argv = [sys.executable, "-m", "agentjet_app.cli", "node", "--role", "trainer"]
    with open(log_path, "wb") as log:
        proc = procs.popen(
            [*argv, "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO_ROOT,
        )
    launched = Trainer(proc, log_path)
    try:
        yield launched
    finally:
        if proc.poll() is None:
            launched.children()
        reap(launched.seen | {proc.pid})
        proc.wait()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_a_sigkilled_trainer_leaves_no_process_behind(trainer: Trainer):
    """hivemind's DHT process and both averagers are forked (the role's marker variable is
    not in their environ), p2pd is exec'd by the DHT process: all end with the trainer."""
    children = trainer.wait_ready()
    [watcher] = [pid for pid, c in children.items() if "agentjet.lifeline" in c]
    token = command_line(watcher).split()[4]  # python -m agentjet.lifeline PID TOKEN ...
    pipe = int(os.readlink(f"/proc/{watcher}/fd/0").removeprefix("pipe:[").rstrip("]"))

    os.kill(trainer.proc.pid, signal.SIGKILL)  # the main process alone
    assert trainer.proc.wait(timeout=KILL_DEADLINE_S) == -signal.SIGKILL

    left = gone_within(set(children), KILL_DEADLINE_S)
    assert {pid: children[pid] for pid in left} == {}
    assert marked_processes(token, pipe) == set()
    assert "is gone; ended" in trainer.log()  # the watcher says what it did


def test_a_trainer_whose_largest_child_is_killed_stops_with_one_error(trainer: Trainer):
    """What the OOM killer does: SIGKILL the largest child (a hivemind averager). The
    trainer stops, its cleanup runs, and its last line names the process and the signal."""
    children = trainer.wait_ready()
    helpers = [pid for pid, c in children.items() if "agentjet_app.cli" in c]
    largest = max(helpers, key=lambda pid: _resident_kib(pid))

    os.kill(largest, signal.SIGKILL)
    code = trainer.proc.wait(timeout=STOP_TIMEOUT_S)

    log = trainer.log()
    assert code == 2, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("agentjet: error:")]
    assert len(errors) == 1, log[-3000:]
    assert errors[0].startswith("agentjet: error: hivemind "), log[-3000:]
    assert f" process {largest} died (SIGKILL: out of memory?); the trainer stops" in errors[0]
    assert "Traceback" not in log, log[-3000:]
    assert gone_within(set(children), KILL_DEADLINE_S) == set()


def _resident_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0
