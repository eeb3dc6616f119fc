"""What an agent or judge may return as an episode's reward (agentjet/episode.py
`as_reward`): a finite number, or with [[policies]] one per policy."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from agentjet.episode import as_reward

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1.0),
        (0.25, 0.25),
        (np.float32(0.5), 0.5),
        ({"planner": 1, "solver": np.float64(0.0)}, {"planner": 1.0, "solver": 0.0}),
    ],
)
def test_numbers_and_a_number_per_policy_are_rewards(value: Any, expected: Any) -> None:
    assert as_reward(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "True is not a number"),
        ("1.0", "'1.0' is not a number"),
        (None, "None is not a number"),
        (math.nan, "nan is not a finite number"),
        ({}, "is an empty mapping"),
        ({"planner": math.inf}, "of 'planner' inf is not a finite number"),
        ({1: 0.5}, "names 1, not a policy"),
        ([1.0], "is not a number"),
    ],
)
def test_anything_else_is_refused_with_why(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        as_reward(value)
