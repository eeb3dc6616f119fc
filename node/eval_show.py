"""`agentjet eval --show N`: the first N tasks as a person checks them by eye.

    (task, its episodes) of the first N tasks ──format_samples──▶ text for stderr
        per task: the prompt, the expected answer, then each answer the model gave with
        the reward it scored (each term, the failure if its reward function failed, and
        whether it was cut at max_new_tokens)

Long texts keep their head and their tail with the middle elided: a task's question and a
model's final answer tend to sit at the ends. The text goes to stderr, so the JSON summary
on stdout stays clean for a pipe.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from agentjet.episode import Episode
from agentjet.protocol import Task

# Characters of a prompt or an answer shown at most (head and tail; the middle elided).
SHOW_CHARS = 600
# How every line of a shown text is indented under its heading.
INDENT = "    "


class Seen:
    """What evaluation keeps of each chunk it plays (play_rewards' `seen`): the first `show`
    tasks with their episodes, and how many answers ended at max_new_tokens (`cut[True]`)
    of those that can (single-turn and sandboxed episodes; agents' are not counted)."""

    def __init__(self, show: int) -> None:
        self.show = show
        self.shown: list[tuple[Task, Sequence[Any]]] = []
        self.cut: Counter[bool] = Counter()

    def __call__(self, chunk: Sequence[Task], episodes: Sequence[Sequence[Any]]) -> None:
        self.shown += list(zip(chunk, episodes, strict=True))[: self.show - len(self.shown)]
        for episode in (e for task_episodes in episodes for e in task_episodes):
            if isinstance(episode, Episode):
                self.cut[episode.finish_reason == "length"] += 1


def shorten(text: str, limit: int = SHOW_CHARS) -> str:
    """`text` stripped, and if longer than `limit`, its head and tail around a note of how
    much was left out."""
    text = text.strip()
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]} [... {len(text) - limit} characters ...] {text[-tail:]}"


def format_samples(
    shown: Sequence[tuple[Task, Sequence[Any]]],
    decode: Callable[[list[int]], str],
    max_new_tokens: int,
    limit: int = SHOW_CHARS,
) -> str:
    """The tasks in `shown` with their episodes (Episode, or an agent's Played), as text;
    `decode` turns completion token ids into text."""
    blocks = []
    for number, (task, episodes) in enumerate(shown, 1):
        lines = [f"--- task {task.id} ({number} of {len(shown)}) ---", "prompt:"]
        lines += _indented(shorten(_prompt_text(task), limit))
        lines.append(f"expected: {shorten(_answer_text(task.answer), limit)}")
        if not episodes:
            lines.append("answers: none (every answer failed to play)")
        for j, episode in enumerate(episodes, 1):
            lines.append(_answer_heading(episode, j, len(episodes), max_new_tokens))
            ids = getattr(episode, "completion_ids", None)
            if ids is None:  # an agent's episode: its calls, not one completion
                calls = getattr(episode, "calls", [])
                lines += _indented(f"(an agent episode of {len(calls)} model calls)")
            else:
                lines += _indented(shorten(decode(list(ids)), limit) or "(empty)")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _answer_heading(episode: Any, j: int, count: int, max_new_tokens: int) -> str:
    """`answer 2 of 4 (reward 0.5; correct 1, short 0; cut at max_new_tokens 32):`"""
    parts = [f"reward {episode.reward:g}"]
    terms = getattr(episode, "reward_terms", {})
    if len(terms) > 1:
        parts.append(", ".join(f"{name} {value:g}" for name, value in terms.items()))
    if episode.error:
        parts.append(episode.error)
    if getattr(episode, "finish_reason", "") == "length":
        parts.append(f"cut at max_new_tokens {max_new_tokens}")
    label = f"answer {j} of {count}" if count > 1 else "answer"
    return f"{label} ({'; '.join(parts)}):"


def _prompt_text(task: Task) -> str:
    if isinstance(task.prompt, str):
        return task.prompt
    return "\n".join(f"[{m['role']}] {m['content']}" for m in task.messages())


def _answer_text(answer: Any) -> str:
    if answer is None:
        return "(none)"
    return answer if isinstance(answer, str) else json.dumps(answer)


def _indented(text: str) -> list[str]:
    return [INDENT + line if line.strip() else "" for line in text.splitlines()] or [""]
