"""Sandbox task generators in a real sandbox: every family's reference passes its check,
wrong and cheating solutions fail; and tasks are the same in every process."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import msgspec
import pytest

from agentjet.protocol import Task
from agentjet.sandbox_tasks import CODE_FAMILIES, SHELL_FAMILIES, reference_solution
from sandboxes.base import ExecResult
from sandboxes.process import ProcessSandbox
from tests import procs
from tests.unit.test_sandbox_tasks import SEEDS, WRONG_COMMANDS, _constant, _made

pytestmark = pytest.mark.integration


# Generous for checks and commands that finish in milliseconds.
CHECK_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def box() -> Iterator[ProcessSandbox]:
    with ProcessSandbox() as sandbox:
        yield sandbox


def _run_code(box: ProcessSandbox, task: Task, solution: str | None) -> ExecResult:
    """Run the check on a fresh work dir holding `solution` as solution.py (None: no file)."""
    box.reset()
    if solution is not None:
        box.put_file("solution.py", solution.encode())
    return box.exec(task.check, timeout_s=CHECK_TIMEOUT_S)


def _run_shell(box: ProcessSandbox, task: Task, commands: str) -> ExecResult:
    """Write the task's files, run `commands` (their own failure is allowed), then the check."""
    box.reset()
    for path, text in task.setup:
        box.put_file(path, text.encode())
    if commands:
        box.exec(commands, timeout_s=COMMAND_TIMEOUT_S, language="sh")
    return box.exec(task.check, timeout_s=CHECK_TIMEOUT_S)


def _failed_with_reason(result: ExecResult) -> bool:
    return result.exit_code == 1 and len(result.stderr.strip().splitlines()) >= 1


# ── write-a-function tasks ────────────────────────────────────────────────────────

# Wraps the reference so that exactly one call (1-based) returns a wrong plain value.
WRONG_ON_CALL = """
_reference = solve
_calls = 0


def solve(arg):
    global _calls
    _calls += 1
    result = _reference(arg)
    if _calls != {call}:
        return result
    if type(result) is bool:
        return not result
    if type(result) is int:
        return result + 1
    if type(result) is str:
        return result + "x"
    return result + [0]
"""


# Wrong or cheating solutions to `solve(xs) = sum(xs)`, each of which must fail.
BAD_SUM_SOLUTIONS = {
    "wrong value": "def solve(xs):\n    return 0\n",
    "raises": "def solve(xs):\n    raise ValueError('no idea')\n",
    "syntax error": "def solve(xs)\n    return sum(xs)\n",
    "no solve": "def total(xs):\n    return sum(xs)\n",
    "right value as str": "def solve(xs):\n    return str(sum(xs))\n",
    "object equal to all": (
        "class Any:\n    def __eq__(self, other):\n        return True\n\n\n"
        "def solve(xs):\n    return Any()\n"
    ),
    "int equal to all": (
        "class Any(int):\n    def __eq__(self, other):\n        return True\n\n\n"
        "def solve(xs):\n    return Any(0)\n"
    ),
    "sys.exit(0) on import": "import sys\nsys.exit(0)\n",
    "os._exit(0) on import": "import os\nos._exit(0)\n",
    "SystemExit in solve": "def solve(xs):\n    raise SystemExit(0)\n",
    "fake results then exit": "import os\nos.write(1, b'[0, 0, 0, 0, 0]')\nos._exit(0)\n",
}


@pytest.mark.parametrize("name", sorted(CODE_FAMILIES))
def test_code_reference_passes_its_check(box: ProcessSandbox, name: str) -> None:
    for seed in SEEDS:
        made = _made(CODE_FAMILIES, name, seed)
        assert made.task.op == name
        assert made.task.difficulty == CODE_FAMILIES[name].difficulty
        assert reference_solution(made.task) == made.reference
        result = _run_code(box, made.task, made.reference)
        assert result.exit_code == 0, (made.task.id, result.stderr)


@pytest.mark.parametrize("name", sorted(CODE_FAMILIES))
def test_code_check_fails_a_solution_wrong_on_one_case(box: ProcessSandbox, name: str) -> None:
    made = _made(CODE_FAMILIES, name, seed=0)
    cases = len(_constant(made.task.check, "INPUTS"))
    assert cases >= 5
    for call in (1, cases):  # an edge case first, and the last case
        solution = made.reference + WRONG_ON_CALL.format(call=call)
        result = _run_code(box, made.task, solution)
        assert _failed_with_reason(result), (made.task.id, call, result)
        assert "returned" in result.stderr


@pytest.mark.parametrize("kind", sorted(BAD_SUM_SOLUTIONS))
def test_code_check_rejects_wrong_and_cheating_solutions(box: ProcessSandbox, kind: str) -> None:
    task = _made(CODE_FAMILIES, "sum", seed=0).task
    result = _run_code(box, task, BAD_SUM_SOLUTIONS[kind])
    assert _failed_with_reason(result), result


def test_code_check_rejects_a_missing_solution(box: ProcessSandbox) -> None:
    result = _run_code(box, _made(CODE_FAMILIES, "sum", seed=0).task, None)
    assert _failed_with_reason(result)
    assert "solution.py is missing" in result.stderr


@pytest.mark.parametrize("module", ["json", "subprocess"])
def test_code_check_imports_no_module_planted_in_the_work_dir(
    box: ProcessSandbox, module: str
) -> None:
    task = _made(CODE_FAMILIES, "sum", seed=0).task
    box.reset()
    box.put_file(f"{module}.py", b"import os\nos._exit(0)\n")
    box.put_file("solution.py", b"def solve(xs):\n    return 0\n")
    result = box.exec(task.check, timeout_s=CHECK_TIMEOUT_S)
    assert _failed_with_reason(result), result


def test_code_check_tells_bools_from_ints_and_lists_from_tuples(box: ProcessSandbox) -> None:
    divisible = _made(CODE_FAMILIES, "divisible", seed=0)
    k = divisible.params["k"]
    as_int = f"def solve(n):\n    return int(n % {k} == 0)\n"
    assert _failed_with_reason(_run_code(box, divisible.task, as_int))

    ordered = _made(CODE_FAMILIES, "sort", seed=0)
    descending = ordered.params["order"] == "desc"
    as_tuple = f"def solve(xs):\n    return tuple(sorted(xs, reverse={descending}))\n"
    assert _failed_with_reason(_run_code(box, ordered.task, as_tuple))


def test_code_check_ends_a_solution_that_never_returns(box: ProcessSandbox) -> None:
    task = _made(CODE_FAMILIES, "sum", seed=0).task
    quick = msgspec.structs.replace(
        task, check=task.check.replace("SOLVE_TIMEOUT_S = 5\n", "SOLVE_TIMEOUT_S = 0.5\n")
    )
    result = _run_code(box, quick, "def solve(xs):\n    while True:\n        pass\n")
    assert _failed_with_reason(result)
    assert "did not return" in result.stderr


def test_code_check_accepts_correct_solutions_written_differently(box: ProcessSandbox) -> None:
    fib = _made(CODE_FAMILIES, "fib", seed=0).task
    naive = "def solve(n):\n    return n if n < 2 else solve(n - 1) + solve(n - 2)\n"
    assert _run_code(box, fib, naive).exit_code == 0

    ordered = _made(CODE_FAMILIES, "sort", seed=0)
    descending = ordered.params["order"] == "desc"
    chatty_in_place = (
        f"def solve(xs):\n    xs.sort(reverse={descending})\n    return xs\n\n\n"
        "print(solve([3, 1, 2]))\n"
        "if __name__ == '__main__':\n    print('main')\n"
    )
    result = _run_code(box, ordered.task, chatty_in_place)
    assert result.exit_code == 0, result.stderr


# ── shell tasks ───────────────────────────────────────────────────────────────────

# After the reference: a line added to every top-level file spoils results and originals.
SPOIL_EVERY_FILE = 'for f in *; do if [ -f "$f" ]; then echo extra >> "$f"; fi; done'


@pytest.mark.parametrize("name", sorted(SHELL_FAMILIES))
def test_shell_reference_passes_its_check(box: ProcessSandbox, name: str) -> None:
    for seed in SEEDS:
        made = _made(SHELL_FAMILIES, name, seed)
        assert made.task.op == name
        assert made.task.difficulty == SHELL_FAMILIES[name].difficulty
        assert reference_solution(made.task) == made.reference
        result = _run_shell(box, made.task, made.reference)
        assert result.exit_code == 0, (made.task.id, made.reference, result.stderr)


@pytest.mark.parametrize("name", sorted(SHELL_FAMILIES))
def test_shell_check_fails_idle_partial_and_wrong_work(box: ProcessSandbox, name: str) -> None:
    made = _made(SHELL_FAMILIES, name, seed=0)
    attempts = ["", *WRONG_COMMANDS[name](made.params), f"{made.reference}; {SPOIL_EVERY_FILE}"]
    for commands in attempts:
        result = _run_shell(box, made.task, commands)
        assert _failed_with_reason(result), (made.task.id, commands, result)


# ── reproducibility ───────────────────────────────────────────────────────────────


def test_tasks_do_not_depend_on_the_hash_seed() -> None:
    """Tasks are the same in every process (a restarted coordinator draws what it drew)."""
    program = (
        "import random, sys, msgspec\n"
        "from agentjet.sandbox_tasks import TASK_MAKERS\n"
        "rng = random.Random(3)\n"
        "tasks = [m(rng, d, e) for e, m in sorted(TASK_MAKERS.items()) for d in (1, 2, 3)]\n"
        "sys.stdout.write(msgspec.json.encode(tasks).decode())\n"
    )
    outputs = {
        procs.run(
            [sys.executable, "-c", program],
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for hash_seed in ("1", "2")
    }
    assert len(outputs) == 1
