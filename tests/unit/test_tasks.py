"""Task sources: every environment's generated tasks (task files: test_task_files.py)."""

from __future__ import annotations

import random

import pytest

from agentjet.tasks import TaskSource

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
