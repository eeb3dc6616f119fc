"""Sandbox task generators: a task is reproducible and named by its id, and its prompt
gives nothing away (run in a real sandbox: tests/integration/test_sandbox_tasks.py)."""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Callable
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

pytestmark = pytest.mark.unit

SEEDS = (0, 1, 2)
# Draws per (maker, difficulty) in the identity tests.
DRAWS = 300


def _made(families: dict[str, Any], name: str, seed: int) -> Made:
    made: Made = families[name].make(random.Random(seed), "test")
    return made


def _constant(check: str, name: str) -> Any:
    """The value a check program assigns to `name` at top level."""
    for node in ast.parse(check).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == name:
            return ast.literal_eval(node.value)
    raise KeyError(name)


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


def test_every_shell_family_has_wrong_commands() -> None:
    assert set(WRONG_COMMANDS) == set(SHELL_FAMILIES)


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
