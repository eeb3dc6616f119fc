"""A reward function on the model's final reply, added to the class's get_reward() (see
`rewards` in config.toml): it gets the task file's row and the final reply's text."""

from __future__ import annotations

from typing import Any


def names_the_number(row: dict[str, Any], completion: str) -> float:
    return float(str(row["secret"]) in completion)
