"""The unit tier's guard (tests/conftest.py, tests/procs.py `ProcessesForbidden`): every way of
starting a process from Python fails a unit test, saying the rule. (That a unit test
which starts one fails, and an integration test may start one: the pytest runs of
tests/integration/test_test_harness.py.)"""

from __future__ import annotations

import ast
import asyncio
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import procs
from tests.conftest import UNIT_RULE

pytestmark = pytest.mark.unit


def _fork() -> None:
    if os.fork() == 0:  # the guard let it through: the child must not run the tests on
        os._exit(0)


async def _exec() -> None:
    await asyncio.create_subprocess_exec("true")


STARTS: dict[str, Callable[[], object]] = {
    "subprocess.run": lambda: subprocess.run(["true"], check=False),
    "subprocess.Popen": lambda: subprocess.Popen([sys.executable, "-c", "pass"]),
    "asyncio subprocess": lambda: asyncio.run(_exec()),
    "os.fork": _fork,
    "os.posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], os.environ),
    "os.system": lambda: os.system("true"),
    "multiprocessing fork": lambda: multiprocessing.get_context("fork").Process().start(),
    "multiprocessing spawn": lambda: multiprocessing.get_context("spawn").Process().start(),
    "the harness's popen": lambda: procs.popen(["true"]),
}


@pytest.mark.parametrize("start", STARTS.values(), ids=STARTS.keys())
def test_a_process_started_in_a_unit_test_fails_it_naming_the_rule(
    start: Callable[[], object], process_guard: procs.ProcessesForbidden
) -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        start()
    assert str(failed.value).endswith(f"tried to start a process; {UNIT_RULE}")
    assert "'unit: pure logic, no processes'" in str(failed.value)
    assert len(process_guard.attempts) == 1
    process_guard.attempts.clear()  # expected here: else the test would fail at teardown


def test_a_guard_puts_back_what_it_replaced() -> None:
    def starters() -> list[object]:
        return [os.fork, os.system, os.posix_spawn, multiprocessing.Process.start]

    before = starters()  # the unit tier's guard's
    with procs.ProcessesForbidden("a rule") as guard:
        with pytest.raises(pytest.fail.Exception, match="^os.system: .* process; a rule$"):
            os.system("true")
        assert guard.attempts == ["os.system"]
    assert all(a is b for a, b in zip(starters(), before, strict=True))


# Test modules that start programs without `procs.popen` / `procs.run`, and why.
STARTERS_OF_THEIR_OWN = {
    "tests/procs.py": "the harness itself",
    "tests/lifeline_role.py": "a stand-in role: what it starts, its lifeline ends",
    "tests/unit/test_process_guard.py": "it starts nothing: the guard refuses each try",
}
SUBPROCESS_STARTS = {"Popen", "run", "call", "check_call", "check_output", "getoutput"}


def test_the_tests_start_programs_through_the_harness() -> None:
    """A program a test starts dies with the test run only if started through tests/procs.py
    (`popen`, `run`): no test module calls subprocess's own, or asyncio's (called, or handed
    to a call such as asyncio.to_thread)."""
    tests = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted(tests.rglob("*.py")):
        name = str(path.relative_to(tests.parent))
        if name in STARTERS_OF_THEIR_OWN:
            continue
        for call in ast.walk(ast.parse(path.read_text())):
            if not isinstance(call, ast.Call):
                continue
            for node in (call.func, *call.args):
                if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                    continue
                owner, attribute = node.value.id, node.attr
                if (owner == "subprocess" and attribute in SUBPROCESS_STARTS) or (
                    owner == "asyncio" and attribute.startswith("create_subprocess")
                ):
                    found.append(f"{name}:{node.lineno} {owner}.{attribute}")
    assert not found, f"start these with tests.procs.popen or .run: {found}"
