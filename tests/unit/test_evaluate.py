"""`agentjet eval`'s arithmetic: a task's success share and the accuracy tables."""

import pytest

from agentjet.protocol import Task
from node.evaluate import decoding, success, summarize

pytestmark = pytest.mark.unit


def task(difficulty: int, op: str) -> Task:
    return Task(id=f"{difficulty}{op}", env="arithmetic", prompt="", answer=0, op=op,
                difficulty=difficulty)  # fmt: skip


def test_a_tasks_success_is_the_share_of_its_answers_that_are_right() -> None:
    assert success([1.0, 0.0, 1.0, 0.5], 4) == 0.5  # partial credit is not right
    assert success([1.0], 1) == 1.0
    assert success([1.0], 3) == 1 / 3  # answers that did not play count as wrong


def test_accuracy_is_the_mean_success_overall_per_difficulty_and_per_op() -> None:
    tasks = [task(1, "+"), task(1, "*"), task(2, "+")]
    # two answers per task; the third task's second answer failed to play
    summary = summarize(tasks, [[1.0, 1.0], [1.0, 0.0], [0.5]], 2)
    assert summary == {
        "overall": 0.5,
        "mean_reward": round((1.0 + 0.5 + 0.25) / 3, 4),  # partial credit counts here
        "by_difficulty": {"1": 0.75, "2": 0.0},
        "by_op": {"*": 0.5, "+": 0.5},
        "n": 3,
    }


def test_decoding_says_how_the_answers_were_produced() -> None:
    assert decoding("arithmetic", 0, 1.0) == "greedy"
    assert decoding("arithmetic", 4, 1.0) == "4 per task, sampled at temperature 1.0"
