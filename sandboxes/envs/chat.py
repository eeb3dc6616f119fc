"""Chat-template token plumbing: first-turn prompts and the tokens between two model turns.

A multi-turn episode grows token-in/token-out: the model's sampled ids are never decoded
and re-encoded (that can change them, and the trainer must see exactly what was sampled).
Only the text *between* model turns — the end of the assistant turn, the next user
message, the next assistant header — is tokenized, and its framing is cut out of the
tokenizer's own chat template so it matches what the template would have rendered:

    … model ids <|im_end|> | \\n<|im_start|>user\\nOutput: 5<|im_end|>\\n<|im_start|>assistant\\n
    (sampled, loss 1)      | (UserTurn.ids: context, loss 0)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from agentjet.episode import Episode, Generator, SamplingParams
from agentjet.errors import ModelError
from agentjet.protocol import Task

# Placeholders rendered through the chat template to find where message content goes.
_ASSISTANT_MARK = "\x00ASSISTANT\x00"
_USER_MARK = "\x00USER\x00"


def task_messages(task: Task, system: str | None) -> list[dict[str, str]]:
    """A task's prompt as chat messages, after the environment's `system` message unless
    the task brings its own."""
    messages = task.messages()
    if system is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system}, *messages]


def chat_prompt_ids(tokenizer: Any, system: str | None, task: Task) -> list[int]:
    """Token ids of `task`'s conversation up to the assistant header.

    `system=None` keeps the template's default system message (SmolLM2 inserts one of
    ~20 tokens); a string replaces it; a task whose prompt has a system message keeps that.
    """
    messages = task_messages(task, system)
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if isinstance(ids, Mapping):  # some transformers versions return a BatchEncoding anyway
        ids = ids["input_ids"]
    return [int(i) for i in ids]


async def single_turn_episodes(
    generator: Generator, system: str | None, tasks: list[Task], n: int, params: SamplingParams
) -> list[list[Episode]]:
    """`n` one-turn episodes per task, all sampled in one engine call, not yet scored:
    result[i][j] is sample j of tasks[i] (single-turn environments score them)."""
    prompts = [chat_prompt_ids(generator.tokenizer, system, task) for task in tasks]
    version = generator.policy_version
    completions = await generator.generate(prompts, n, params)
    groups: list[list[Episode]] = []
    for prompt, samples in zip(prompts, completions, strict=True):
        group = []
        for completion in samples:
            episode = Episode(prompt_ids=list(prompt), policy_version=version)
            episode.add_model_turn(completion)
            group.append(episode)
        groups.append(group)
    return groups


T = TypeVar("T")


async def scored_single_turn(
    generator: Generator,
    system: str | None,
    tasks: list[Task],
    n: int,
    params: SamplingParams,
    score: Callable[[Task, list[str]], Awaitable[T]],
) -> tuple[list[list[Episode]], list[T]]:
    """`single_turn_episodes`, and `score(task, its completions' text)` for every task at
    once: what a one-turn environment scored by a function of the text does."""
    groups = await single_turn_episodes(generator, system, tasks, n, params)
    decode = generator.tokenizer.decode
    scores = await asyncio.gather(
        *(
            score(task, [decode(e.completion_ids, skip_special_tokens=True) for e in group])
            for task, group in zip(tasks, groups, strict=True)
        )
    )
    return groups, list(scores)


class UserTurn:
    """Builds the context ids that close a model turn and open the next one with a user
    message. Derived once from the tokenizer's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        rendered = tokenizer.apply_chat_template(
            [
                {"role": "user", "content": "question"},
                {"role": "assistant", "content": _ASSISTANT_MARK},
                {"role": "user", "content": _USER_MARK},
            ],
            add_generation_prompt=True,
            tokenize=False,
        )
        end_of_turn = tokenizer.eos_token
        between = rendered.split(_ASSISTANT_MARK, 1)[-1]
        if not end_of_turn or not between.startswith(end_of_turn) or _USER_MARK not in between:
            raise ModelError(
                "multi-turn environments need a chat template that ends an assistant turn "
                f"with the eos token ({end_of_turn!r}); this tokenizer's template does not"
            )
        head, tail = between[len(end_of_turn) :].split(_USER_MARK)
        self.end_of_turn_id: int = tokenizer.convert_tokens_to_ids(end_of_turn)
        self._head_ids = self._encode(head)
        self._tail_ids = self._encode(tail)

    def ids(self, model_turn_ids: list[int], content: str) -> list[int]:
        """Context ids after `model_turn_ids`: its end-of-turn token when the model did not
        emit one (cut off by the token limit), then the user message and the assistant header.

        `content` comes from a program the model wrote, so special-token text in it is
        tokenized as plain text: printed "<|im_start|>" cannot forge a turn.
        """
        closed = bool(model_turn_ids) and model_turn_ids[-1] == self.end_of_turn_id
        close = [] if closed else [self.end_of_turn_id]
        body = self._encode(content, split_special_tokens=True)
        return close + self._head_ids + body + self._tail_ids

    def _encode(self, text: str, **kwargs: Any) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False, **kwargs)]
