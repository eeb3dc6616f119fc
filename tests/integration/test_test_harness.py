"""The test harness itself (tests/conftest.py, tests/procs.py), run as a developer runs it:
pytest on a small generated test file, in a process of its own.

Every process a test starts dies with the test run, even when pytest is SIGKILLed or
SIGTERMed and so runs no teardown: a program started through `procs.popen`, and a child
forked from the test process (as hivemind's DHT and averagers are). A unit test that
starts a process fails, saying the rule, and one that catches that failure and passes
fails at teardown, as does one that leaves running a process started from C (where the
guard cannot see it start); an integration test may start one.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests import procs
from tests.conftest import UNIT_RULE

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# The inner pytest imports torch and the harness before its test starts its children.
START_TIMEOUT_S = 120.0
# A killed pytest's children get SIGKILL from the kernel as it exits: gone within this.
GONE_WITHIN_S = 10.0
# How often the test looks for the file the inner test writes once its children run.
POLL_S = 0.05
# Longer than any test: the children end only when something ends them.
FOREVER_S = 600

STARTS_CHILDREN = """
    import multiprocessing
    import sys
    import time
    from pathlib import Path

    import pytest

    from tests import procs

    pytestmark = pytest.mark.integration


    def test_starts_children_then_waits_to_be_killed() -> None:
        program = procs.popen([sys.executable, "-c", "import time; time.sleep({forever})"])
        forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=({forever},))
        forked.start()
        Path({pids!r}).write_text(f"{{program.pid}} {{forked.pid}}")
        time.sleep({forever})
"""

STARTS_A_PROCESS = """
    import subprocess

    import pytest
    import torch


    @pytest.mark.unit
    def test_a_unit_test_that_starts_a_process() -> None:
        subprocess.run(["true"], check=True)


    @pytest.mark.unit
    def test_a_unit_test_that_catches_the_failure() -> None:
        try:
            subprocess.run(["true"], check=True)
        except BaseException:
            pass


    @pytest.mark.unit
    def test_a_unit_test_that_starts_a_process_from_c() -> None:
        torch.multiprocessing.set_sharing_strategy("file_system")  # as hivemind sets it
        torch.zeros(1).share_memory_()  # torch starts its torch_shm_manager


    @pytest.mark.integration
    def test_an_integration_test_that_starts_a_process() -> None:
        subprocess.run(["true"], check=True)
"""


@contextmanager
def pytest_of(test_file: Path, *options: str) -> Iterator[subprocess.Popen[str]]:
    """pytest on `test_file` with this repository's harness, in a process of its own (its
    output in test_file's folder); killed and reaped by PID if still running at the end."""
    argv = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    argv += ["-c", str(REPO / "pyproject.toml"), "--basetemp", str(test_file.parent / "tmp")]
    log = (test_file.parent / "pytest.log").open("w")
    proc = procs.popen([*argv, *options, str(test_file)], cwd=REPO, stdout=log, stderr=log)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()


def written(path: Path, proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The text `path` holds once written (a bounded wait), failing if `proc` ends first."""
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            output = (path.parent / "pytest.log").read_text()
            pytest.fail(f"no {path.name} from pytest (exit code {proc.poll()}):\n{output}")
        time.sleep(POLL_S)
    return path.read_text()


def exited_within(pidfds: list[int], timeout_s: float) -> list[int]:
    """The pidfds whose processes exit within `timeout_s` (a pidfd reads ready then)."""
    deadline = time.monotonic() + timeout_s
    waiting = set(pidfds)
    while waiting and (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select(list(waiting), [], [], left)
        waiting -= set(ready)
    return [fd for fd in pidfds if fd not in waiting]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_pytests_processes_die_with_it(tmp_path: Path, sig: signal.Signals) -> None:
    pids_file = tmp_path / "pids"
    test_file = tmp_path / "test_children.py"
    source = STARTS_CHILDREN.format(forever=FOREVER_S, pids=str(pids_file))
    test_file.write_text(textwrap.dedent(source))
    with pytest_of(test_file) as inner:
        program, forked = map(int, written(pids_file, inner, START_TIMEOUT_S).split())
        pidfds = [os.pidfd_open(program), os.pidfd_open(forked)]
        try:
            assert exited_within(pidfds, 0.0) == [], "both children run before the kill"
            inner.send_signal(sig)
            assert inner.wait(GONE_WITHIN_S) == -sig
            gone = exited_within(pidfds, GONE_WITHIN_S)
            left = [
                pid for pid, fd in zip((program, forked), pidfds, strict=True) if fd not in gone
            ]
            assert left == [], f"still running after pytest's {sig.name}: {left}"
        finally:
            for fd in pidfds:
                os.close(fd)
    assert not procs.alive(program) and not procs.alive(forked)


def test_a_unit_test_that_starts_a_process_fails_saying_the_rule(tmp_path: Path) -> None:
    test_file = tmp_path / "test_starts.py"
    test_file.write_text(textwrap.dedent(STARTS_A_PROCESS))
    report = tmp_path / "report.xml"
    with pytest_of(test_file, f"--junitxml={report}") as inner:
        inner.wait(START_TIMEOUT_S)
    cases = {
        case.attrib["name"]: {child.tag: child.attrib.get("message", "") for child in case}
        for case in ElementTree.parse(report).iter("testcase")
    }
    starts = cases["test_a_unit_test_that_starts_a_process"]
    catches = cases["test_a_unit_test_that_catches_the_failure"]
    assert set(starts) == {"failure"}
    assert f"subprocess.Popen: this test tried to start a process; {UNIT_RULE}" in starts["failure"]
    assert set(catches) == {"error"}, "the call passed; its teardown fails"
    assert f"subprocess.Popen: tried to start a process; {UNIT_RULE}" in catches["error"]
    from_c = cases["test_a_unit_test_that_starts_a_process_from_c"]
    assert set(from_c) == {"error"}, "it passed; its teardown sees the process"
    assert "started processes still running: " in from_c["error"]
    assert "torch_shm_manager" in from_c["error"] and UNIT_RULE in from_c["error"]
    assert cases["test_an_integration_test_that_starts_a_process"] == {}
