"""The your-own-data learning task of `just bench-learn --task parity`: classify numbers.

    "Is 347 an even or an odd number? ..." ──SmolLM2──▶ "347 is an odd number." ──reward──▶ 1.0

A classification dataset with word answers ("even", "odd") scored by a user reward
function, made here (nothing loads from a hub). SmolLM2-135M-Instruct answers "even"
almost always when greedy (50% right) and mixes both when sampling (about a quarter of
answers right: many name neither class), so groups are mixed and GRPO has a signal.
Rows are split by number: held-out numbers never appear in training.
"""

from __future__ import annotations

import random
import re
from typing import Any

PROMPT = "Is {n} an even or an odd number? Answer with one word: even or odd."


def rows(numbers: list[int]) -> list[dict[str, Any]]:
    """Task rows; `difficulty` is the number of digits (reported per digit count)."""
    return [
        {"id": f"n{n}", "prompt": PROMPT.format(n=n), "answer": "even" if n % 2 == 0 else "odd",
         "difficulty": len(str(n))}
        for n in numbers
    ]  # fmt: skip


def split(held_out: int, seed: int = 12345) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, held-out rows) over 0..999, the held-out numbers drawn by `seed`."""
    numbers = list(range(1000))
    random.Random(seed).shuffle(numbers)
    return rows(sorted(numbers[held_out:])), rows(sorted(numbers[:held_out]))


def first_class(task: dict[str, Any], completion: str) -> float:
    """1.0 when the first "even" or "odd" in the completion is the row's answer."""
    said = re.findall(r"\b(even|odd)\b", completion.lower())
    return float(bool(said) and said[0] == task["answer"])
