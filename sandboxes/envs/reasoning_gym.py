"""The "reasoning_gym" environment: one model turn on a reasoning-gym row, scored by the
dataset's own scorer (agentjet/reasoning_gym_tasks.py holds the package).

    task (a row drawn by id) ──system prompt + question──▶ await generate(n) ──▶ n completions
        ──▶ in a thread of its own, bounded by REWARD_TIMEOUT_S for the group:
            GymTasks.score(task, text): <answer>...</answer> ──▶ dataset.score_answer ∈ [0, 1]
        ──▶ episode.reward; reward_terms {<dataset name>: reward} (the metrics' reward/<name>)

The scorer is the package's code run on the model's text: one that raises, returns junk or
runs past its time scores the sample 0 and marks it (`Episode.error`, beginning as a prompt
environment's failed reward does, so a trainer's re-check leaves it be), counted per kind
and logged once per kind; the run goes on. Trainers re-score with the same `GymTasks`
(node/verify.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from agentjet.bridge import detached
from agentjet.episode import Episode, Generator, SamplingParams
from agentjet.protocol import Task
from agentjet.reasoning_gym_tasks import GymTasks, ScoreError
from agentjet.roles import wait_for
from sandboxes.envs.chat import scored_single_turn
from sandboxes.envs.prompt import REWARD_ERROR, REWARD_TIMEOUT_S

log = logging.getLogger(__name__)


class ReasoningGymEnv:
    """Single-turn: the row's question under reasoning-gym's system prompt, its scorer's score."""

    name = "reasoning_gym"

    def __init__(
        self, tasks: GymTasks, system_prompt: str | None, timeout_s: float = REWARD_TIMEOUT_S
    ) -> None:
        """`system_prompt=None` keeps the chat template's default system message."""
        self.tasks = tasks
        self.system_prompt = system_prompt
        self.timeout_s = timeout_s
        self.errors: Counter[str] = Counter()  # kind of failure -> samples it failed

    async def run_group(
        self, generator: Generator, tasks: list[Task], n: int, params: SamplingParams
    ) -> list[list[Episode]]:
        groups, scored = await scored_single_turn(
            generator, self.system_prompt, tasks, n, params, self.score
        )
        for task, group, results in zip(tasks, groups, scored, strict=True):
            for episode, (reward, error) in zip(group, results, strict=True):
                episode.reward, episode.error = reward, error
                episode.reward_terms = {task.op: reward}
        return groups

    async def score(self, task: Task, completions: Sequence[str]) -> list[tuple[float, str]]:
        """(reward, error) per completion; never raises for what the scorer does."""

        def run() -> list[tuple[float, str]]:
            results = []
            for completion in completions:
                try:
                    results.append((self.tasks.score(task, completion), ""))
                except ScoreError as e:
                    results.append((0.0, self._failed(str(e), e.__cause__)))
            return results

        try:
            return await wait_for(detached(run), self.timeout_s)
        except TimeoutError:
            error = self._failed(f"{task.op}: scoring ran past {self.timeout_s:g} s", None)
            return [(0.0, error)] * len(completions)

    def _failed(self, kind: str, cause: BaseException | None) -> str:
        if kind not in self.errors:
            log.warning("reasoning-gym %s%s (the sample scores 0; logged once per kind)",
                        kind, f": {cause}" if cause else "")  # fmt: skip
        self.errors[kind] += 1
        return f"{REWARD_ERROR}{kind}"

    def metrics(self) -> dict[str, int]:
        """Samples whose scoring failed so far, overall."""
        return {"reward/errors": sum(self.errors.values())}
