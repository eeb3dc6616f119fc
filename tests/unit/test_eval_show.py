"""`agentjet eval --show`: what a reader sees of a task, its answers and their rewards."""

import pytest

from agentjet.episode import Episode
from agentjet.protocol import Task
from node.eval_show import format_samples, shorten

pytestmark = pytest.mark.unit


def test_long_text_keeps_its_head_and_tail() -> None:
    assert shorten("  short  ") == "short"
    text = "Q" + "x" * 100 + "A: 42"
    kept = shorten(text, 20)
    assert kept.startswith("Qxxxxxxxxx") and kept.endswith("xxxxxA: 42")
    assert "[... 86 characters ...]" in kept


def test_a_task_shows_its_prompt_expected_answer_and_each_scored_answer() -> None:
    task = Task(id="t1", env="prompt", prompt="How many legs?\n\nThink.", answer=292)
    right = Episode(prompt_ids=[1], completion_ids=[7, 8], reward=1.0, finish_reason="stop")
    right.reward_terms = {"correct": 1.0, "short": 0.0}
    cut = Episode(prompt_ids=[1], completion_ids=[9], finish_reason="length")
    failed = Episode(prompt_ids=[1], completion_ids=[], error="reward correct: raised KeyError")
    text = format_samples([(task, [right, cut, failed])], lambda ids: f"ids {ids}", 32)
    assert text.splitlines() == [
        "--- task t1 (1 of 1) ---",
        "prompt:",
        "    How many legs?",
        "",
        "    Think.",
        "expected: 292",
        "answer 1 of 3 (reward 1; correct 1, short 0):",
        "    ids [7, 8]",
        "answer 2 of 3 (reward 0; cut at max_new_tokens 32):",
        "    ids [9]",
        "answer 3 of 3 (reward 0; reward correct: raised KeyError):",
        "    ids []",
    ]


def test_a_task_without_answers_says_so() -> None:
    task = Task(id="t2", env="prompt", prompt="Hi", answer=None)
    text = format_samples([(task, [])], str, 32)
    assert "expected: (none)" in text and "answers: none" in text
