"""The arithmetic environment: one model turn, reward 1 when the final integer is right
(and, with partial_credit, a share of that for each digit place a wrong one has right).

task prompt ──chat template──▶ prompt ids ──await generate(n)──▶ n completions ──▶ n Episodes
                                                             └─ final integer == answer?
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentjet.episode import Episode, Generator, SamplingParams
from agentjet.protocol import Task
from sandboxes.envs.chat import single_turn_episodes
from sandboxes.envs.parsing import exact_answer_reward

# None keeps SmolLM2's default system message ("You are a helpful AI assistant named
# SmolLM, trained by Hugging Face", 20 tokens). Shorter ones cost SmolLM2-135M most of its
# base accuracy (greedy, 90 tasks per digit count, 1-/2-/3-digit correct): default 61/6/1;
# "You are a helpful assistant." 40/3/0; "You are a calculator." 40/3/0; "You are a helpful
# AI assistant named SmolLM." 40/4/0; empty 24/4/0. Saving 6-16 prompt tokens is not worth it.
ARITHMETIC_SYSTEM_PROMPT: str | None = None


def score_completion(
    tokenizer: Any, token_ids: Sequence[int], task: Task, partial_credit: float = 0.0
) -> float:
    """The reward of one completion of `task`; trainers re-check rewards with it too."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    return exact_answer_reward(text, task.answer, partial_credit)


class ArithmeticEnv:
    """Single-turn question answering verified by `parsing.exact_answer_reward`."""

    name = "arithmetic"

    def __init__(
        self, system_prompt: str | None = ARITHMETIC_SYSTEM_PROMPT, partial_credit: float = 0.0
    ) -> None:
        """`system_prompt=None` keeps the chat template's default system message;
        `partial_credit`: EnvConfig.partial_credit."""
        self.system_prompt = system_prompt
        self.partial_credit = partial_credit

    async def run_group(
        self, generator: Generator, tasks: list[Task], n: int, params: SamplingParams
    ) -> list[list[Episode]]:
        """`n` episodes per task, all sampled in one engine call; result[i][j] = task i, j."""
        groups = await single_turn_episodes(generator, self.system_prompt, tasks, n, params)
        for task, group in zip(tasks, groups, strict=True):
            for episode in group:
                episode.reward = score_completion(
                    generator.tokenizer, episode.completion_ids, task, self.partial_credit
                )
        return groups
