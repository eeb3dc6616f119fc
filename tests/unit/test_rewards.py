"""Reward functions of "prompt" environments: sync, async, several terms, and every way
the user's function can fail, which costs that sample its reward, never the run."""

from __future__ import annotations

import logging

import pytest
import uvloop

from agentjet.config import RewardTerm
from agentjet.errors import ConfigError
from agentjet.protocol import Task
from sandboxes.envs.prompt import REWARD_ERROR, Rewards, Scored

pytestmark = pytest.mark.unit

TASK = Task(id="q1", env="prompt", prompt="Capital of France?", answer="Paris",
            fields={"max_chars": 12})  # fmt: skip


def score(terms: list[tuple[str, str, float]], completions: list[str], **kw: float) -> list[Scored]:
    rewards = Rewards([RewardTerm(name=n, function=f, weight=w) for n, f, w in terms], **kw)
    return uvloop.run(rewards.score(TASK, completions))


def test_a_sync_function_scores_each_completion_given_the_row() -> None:
    scored = score([("right", "tests.rewards:says_answer", 1.0)], ["It is Paris.", "Lyon"])
    assert [s.reward for s in scored] == [1.0, 0.0]  # True and False count as 1 and 0
    assert [s.error for s in scored] == ["", ""]


def test_weighted_terms_sum_and_each_is_kept_for_the_metrics() -> None:
    terms = [
        ("right", "tests.rewards:says_answer", 1.0),
        ("brevity", "tests.rewards:length_penalty", 0.5),  # async
    ]
    long_right, short_wrong = score(terms, ["Paris, the capital.", "Nice"])
    assert long_right.terms == {"right": 1.0, "brevity": pytest.approx(-0.7)}
    assert long_right.reward == pytest.approx(1.0 - 0.35)
    assert short_wrong.terms == {"right": 0.0, "brevity": 0.0}
    assert short_wrong.reward == 0.0


@pytest.mark.parametrize(
    ("function", "kind"),
    [
        ("tests.rewards:raises", "raised KeyError"),
        ("tests.rewards:returns_text", "returned a str, not a number"),
        ("tests.rewards:returns_nan", "returned nan"),
        ("tests.rewards:never_returns", "ran past 0.05 s"),
    ],
)
def test_a_failing_function_scores_the_sample_zero_and_is_logged_once_per_kind(
    function: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    terms = [RewardTerm(name="right", function="tests.rewards:says_answer"),
             RewardTerm(name="bad", function=function)]  # fmt: skip
    rewards = Rewards(terms, timeout_s=0.05)
    with caplog.at_level(logging.WARNING):
        scored = uvloop.run(rewards.score(TASK, ["Paris", "Paris", "Paris"]))
    assert [s.reward for s in scored] == [0.0] * 3  # the good term does not rescue it
    assert all(s.error == f"{REWARD_ERROR}bad: {kind}" for s in scored)
    # (a trainer's re-check gives up on a function that ran past its time: node/verify.py)
    assert all(s.timed_out == kind.startswith("ran past") for s in scored)
    assert rewards.metrics() == {"reward/errors": 3}
    logged = [r.message for r in caplog.records if "reward bad" in r.message]
    assert len(logged) == 1 and kind in logged[0]


def test_a_function_that_cannot_be_loaded_fails_at_start_in_one_line() -> None:
    with pytest.raises(ConfigError, match="cannot be loaded"):
        Rewards([RewardTerm(name="r", function="tests.rewards:no_such_function")])
    with pytest.raises(ConfigError, match="cannot be loaded"):
        Rewards([RewardTerm(name="r", function="no_such_module:score")])


def test_each_call_gets_its_own_copy_of_the_row() -> None:
    terms = [("meddle", "tests.rewards:mutates", 1.0), ("right", "tests.rewards:says_answer", 1.0)]
    first, second = score(terms, ["Paris", "paris"])
    assert first.reward == second.reward == 1.0  # says_answer still saw "Paris"
    assert TASK.answer == "Paris" and "seen" not in TASK.fields
