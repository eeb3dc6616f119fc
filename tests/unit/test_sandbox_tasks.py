"""Sandbox task generators: every family's reference passes its check in a real sandbox,
wrong and cheating solutions fail, and a task is reproducible and named by its id."""

from __future__ import annotations

import ast
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from agentjet.protocol import Task
from agentjet.sandbox_tasks import (
    CODE_FAMILIES,
    DIFFICULTIES,
    SHELL_FAMILIES,
    TASK_MAKERS,
    Made,
    Params,
    make_code_task,
    make_shell_task,
    reference_solution,
)
from sandboxes.base import ExecResult
from sandboxes.process import ProcessSandbox

pytestmark = pytest.mark.unit

SEEDS = (0, 1, 2)
# Generous for checks and commands that finish in milliseconds.
CHECK_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 5.0
# Draws per (maker, difficulty) in the identity tests.
DRAWS = 300


@pytest.fixture(scope="module")
def box() -> Iterator[ProcessSandbox]:
    with ProcessSandbox() as sandbox:
        yield sandbox


def _made(families: dict[str, Any], name: str, seed: int) -> Made:
    made: Made = families[name].make(random.Random(seed), "test")
    return made


def _constant(check: str, name: str) -> Any:
    """The value a check program assigns to `name` at top level."""
    for node in ast.parse(check).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == name:
            return ast.literal_eval(node.value)
    raise KeyError(name)


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

# Per family: commands that do the task partly or wrongly, given the task's parameters.
WRONG_COMMANDS: dict[str, Callable[[Params], list[str]]] = {
    "create": lambda p: [
        f"echo {p['word']}s > {p['file']}",
        f"echo {p['word']} > other.txt",
        f"touch {p['file']}",
    ],
    "rename": lambda p: [f"cp {p['old']} {p['new']}", f"rm {p['old']}; touch {p['new']}"],
    "append": lambda p: [
        f"echo {p['word']} > {p['file']}",
        f"(echo {p['word']}; cat {p['file']}) > new && mv new {p['file']}",
    ],
    "sum": lambda p: [
        f"head -n 1 numbers.txt > {p['target']}",
        f"wc -l < numbers.txt > {p['target']}",
    ],
    "backup": lambda p: [
        f"mkdir {p['dir']} && cp $(ls *.log | head -n 1) {p['dir']}/",
        f"mkdir {p['dir']} && mv *.log {p['dir']}/",
        f"mkdir {p['dir']} && cp *.* {p['dir']}/",
        f"mkdir {p['dir']} && for f in *.log; do ln -s ../$f {p['dir']}/$f; done",
    ],
    "delete": lambda p: [
        "rm -f ./*",
        f"rm $(ls *{p['ext']} | head -n 1)",
        f"rm ./*{p['ext']}*",
    ],
    "count_lines": lambda p: [
        "wc -l < data.csv > count.txt",
        f"grep -c -F {p['word']} data.csv",
    ],
    "list_files": lambda p: [
        "ls > list.txt",
        f"ls *{p['ext']} | sort -r > list.txt",
        f"ls *{p['ext']}",
    ],
    "replace": lambda p: [
        f"sed -i 's/{p['old']}/{p['new']}/' config.txt",
        f"sed 's/{p['old']}/{p['new']}/g' config.txt",
    ],
}

# After the reference: a line added to every top-level file spoils results and originals.
SPOIL_EVERY_FILE = 'for f in *; do if [ -f "$f" ]; then echo extra >> "$f"; fi; done'


def test_every_shell_family_has_wrong_commands() -> None:
    assert set(WRONG_COMMANDS) == set(SHELL_FAMILIES)


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


# ── identity, reproducibility, prompts ────────────────────────────────────────────


@pytest.mark.parametrize("env", sorted(TASK_MAKERS))
def test_makers_cover_every_difficulty_with_several_families(env: str) -> None:
    families = {"python_code": CODE_FAMILIES, "shell": SHELL_FAMILIES}[env]
    for difficulty in DIFFICULTIES:
        assert sum(f.difficulty == difficulty for f in families.values()) >= 3
        task = TASK_MAKERS[env](random.Random(0), difficulty, env)
        assert (task.env, task.difficulty, task.answer) == (env, difficulty, None)
        assert task.check


def test_reference_solution_refuses_tasks_it_did_not_make() -> None:
    made = _made(CODE_FAMILIES, "mul", seed=0)
    foreign = [
        Task(id="d1:1+2", env="arithmetic", prompt="What is 1 + 2?", answer=3),
        Task(id="code:nosuch", env="python_code", prompt="?"),
        msgspec.structs.replace(made.task, id="code:mul:x"),
        msgspec.structs.replace(made.task, id="code:mul:7:7"),
        msgspec.structs.replace(made.task, check="import sys\nsys.exit(0)\n"),
    ]
    for task in foreign:
        with pytest.raises(ValueError, match="not made by"):
            reference_solution(task)


@pytest.mark.parametrize("maker", [make_code_task, make_shell_task])
def test_an_unknown_difficulty_is_refused(maker: Callable[..., Task]) -> None:
    with pytest.raises(ValueError, match="difficulty 4"):
        maker(random.Random(0), 4)


@pytest.mark.parametrize("env", sorted(TASK_MAKERS))
def test_the_same_seed_makes_the_same_tasks(env: str) -> None:
    def draw(seed: int) -> list[Task]:
        rng = random.Random(seed)
        return [TASK_MAKERS[env](rng, d, env) for _ in range(20) for d in DIFFICULTIES]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


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
        subprocess.run(
            [sys.executable, "-c", program],
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for hash_seed in ("1", "2")
    }
    assert len(outputs) == 1


@pytest.mark.parametrize("env", sorted(TASK_MAKERS))
@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_one_id_names_one_task(env: str, difficulty: int) -> None:
    rng = random.Random(11)
    by_id: dict[str, Task] = {}
    for _ in range(DRAWS):
        task = TASK_MAKERS[env](rng, difficulty, env)
        assert by_id.setdefault(task.id, task) == task
    contents = {(t.prompt, t.setup) for t in by_id.values()}
    assert len(contents) == len(by_id)  # distinct tasks, distinct ids
    families = {"python_code": CODE_FAMILIES, "shell": SHELL_FAMILIES}[env]
    assert {t.op for t in by_id.values()} == {
        f.name for f in families.values() if f.difficulty == difficulty
    }
    if env == "shell" and difficulty > 1:  # thousands of variants per family
        assert len(by_id) >= 0.95 * DRAWS


@pytest.mark.parametrize("name", sorted(CODE_FAMILIES))
def test_code_prompts_hold_no_hidden_case(name: str) -> None:
    for seed in SEEDS:
        task = _made(CODE_FAMILIES, name, seed).task
        assert task.setup == ()  # nothing in the work dir but the solution
        assert task.prompt.count("solve(") == 1  # the signature, no worked example
        assert task.prompt.endswith("Reply with one ```python code block.")
        hidden = _constant(task.check, "INPUTS") + _constant(task.check, "EXPECTED")
        for value in hidden:
            if isinstance(value, list) and value or isinstance(value, str) and len(value) > 1:
                assert json.dumps(value) not in task.prompt
                assert repr(value) not in task.prompt


@pytest.mark.parametrize("name", sorted(SHELL_FAMILIES))
def test_shell_prompts_hold_no_answer(name: str) -> None:
    for seed in SEEDS:
        task = _made(SHELL_FAMILIES, name, seed).task
        constants = {
            key: _constant(task.check, key)
            for key in ("NUMBER", "NAMES", "AFTER", "TEXT")
            if re.search(rf"^{key} = ", task.check, re.MULTILINE)
        }
        if "NUMBER" in constants:
            assert not re.search(rf"\b{constants['NUMBER']}\b", task.prompt)
        for line in constants.get("NAMES", []) + constants.get("AFTER", []):
            assert line not in task.prompt
        for _, text in task.setup:
            assert text.strip() not in task.prompt
