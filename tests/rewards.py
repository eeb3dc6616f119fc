"""Reward functions for tests of "prompt" environments (`reward = "tests.rewards:NAME"`)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

# `blocks` sets ENTERED when called, and returns once a test sets RELEASE (never, in a
# process of its own): a sync function that hangs, whose thread a test can still end.
ENTERED = threading.Event()
RELEASE = threading.Event()


def even_length(task: dict[str, Any], completion: str) -> float:
    """1 when the completion has an even number of characters: the tiny random model earns
    it about half the time, so groups have mixed rewards (it never answers anything)."""
    return float(len(completion) % 2 == 0)


def says_answer(task: dict[str, Any], completion: str) -> bool:
    """Whether the completion contains the row's answer (a word, or any of a list)."""
    answers = task["answer"] if isinstance(task["answer"], list) else [task["answer"]]
    return any(str(a).lower() in completion.lower() for a in answers)


async def length_penalty(task: dict[str, Any], completion: str) -> float:
    """An async term: minus the completion's length over the row's `max_chars`."""
    await asyncio.sleep(0)
    return -max(0, len(completion) - task.get("max_chars", 10)) / 10


def raises(task: dict[str, Any], completion: str) -> float:
    raise KeyError("no such column")


def returns_text(task: dict[str, Any], completion: str) -> Any:
    return "1.0"


def returns_nan(task: dict[str, Any], completion: str) -> float:
    return float("nan")


async def never_returns(task: dict[str, Any], completion: str) -> float:
    await asyncio.Event().wait()
    return 0.0


def blocks(task: dict[str, Any], completion: str) -> float:
    """A sync function that hangs until RELEASE is set; then it scores 0."""
    ENTERED.set()
    RELEASE.wait()
    return 0.0


def mutates(task: dict[str, Any], completion: str) -> float:
    """Changes the row it was given: no other call may see that."""
    task["answer"] = "something else"
    task.setdefault("seen", []).append(completion)
    return 0.0
