"""Task sources: every environment's generated tasks, and task files with their checks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from agentjet.errors import TaskFileError
from agentjet.protocol import Task
from agentjet.tasks import TaskSource, load_task_file

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("env", ["python_code", "shell"])
def test_sandboxed_environments_get_their_own_generated_tasks(env: str) -> None:
    source = TaskSource(env, difficulties=[2, 3])
    tasks = [source.sample(random.Random(seed)) for seed in range(40)]
    assert {t.env for t in tasks} == {env}
    assert {t.difficulty for t in tasks} == {2, 3}
    assert all(
        t.check and t.id.startswith("code:" if env == "python_code" else "shell:") for t in tasks
    )
    assert all(source.covers(t) for t in tasks)
    assert not TaskSource(env, difficulties=[1]).covers(tasks[0])


def test_arithmetic_sources_cover_only_their_ops_and_difficulties() -> None:
    task = TaskSource("arithmetic", [2], ["*"]).sample(random.Random(0))
    assert TaskSource("arithmetic", [2], ["*", "+"]).covers(task)
    assert not TaskSource("arithmetic", [2], ["+"]).covers(task)
    assert not TaskSource("arithmetic", [1], ["*"]).covers(task)


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_task_files_carry_setup_files_and_checks(tmp_path: Path) -> None:
    row = {
        "id": "count",
        "prompt": "Count the lines of a.txt into n.txt.",
        "setup": {"a.txt": "1\n2\n", "sub/b.txt": "x"},
        "check": "import sys; sys.exit(open('n.txt').read().strip() != '2')",
        "difficulty": 2,
    }
    [task] = load_task_file(_write(tmp_path / "t.jsonl", [row]), env="shell")
    assert task == Task(
        id="count",
        env="shell",
        prompt=row["prompt"],  # type: ignore[arg-type]
        difficulty=2,
        setup=(("a.txt", "1\n2\n"), ("sub/b.txt", "x")),
        check=row["check"],  # type: ignore[arg-type]
    )
    hash(task)  # tasks stay hashable with their files


@pytest.mark.parametrize(
    ("env", "row", "error"),
    [
        ("shell", {"id": "a", "prompt": "p"}, 'line 1: shell tasks need a "check" program'),
        ("python_code", {"id": "a", "prompt": "p", "answer": 1}, 'need a "check"'),
        ("arithmetic", {"id": "a", "prompt": "p", "check": "x"}, 'need an integer "answer"'),
        ("shell", {"id": "a", "prompt": "p", "check": "x", "setup": ["a"]}, "line 1: Expected"),
    ],
)
def test_task_file_rows_missing_their_verifier_are_refused(
    tmp_path: Path, env: str, row: dict[str, object], error: str
) -> None:
    with pytest.raises(TaskFileError, match=error):
        load_task_file(_write(tmp_path / "t.jsonl", [row]), env=env)
