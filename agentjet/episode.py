"""The narrow interface between environments and inference engines.

    environment ──prompts (token ids)──▶ await Generator.generate ──▶ Completions (ids, logprobs)
         │
         └──▶ Episode (prompt ids, completion ids incl. tool tokens, logprobs, loss mask, reward)

Engines (torch, vLLM) live in `node/`, environments in `sandboxes/`; both speak only these
types, so neither imports the other. No torch here. `generate` is a coroutine: environments
await it on the caller's event loop, and the engine takes its compute across the one
bridge to a thread (agentjet/bridge.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from agentjet.timeline import Sequence


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    # Greedy decoding (evaluation): argmax, logprobs still reported.
    greedy: bool = False


@dataclass
class Completion:
    """Token ids exactly as sampled, the sampler's logprob of each, and why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


class Generator(Protocol):
    """What an environment needs from an engine."""

    # A Hugging Face tokenizer (chat template, encode/decode).
    tokenizer: Any

    @property
    def policy_version(self) -> int:
        """The policy version of the weights currently loaded."""
        ...

    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Completion]]:
        """`n` completions for each prompt: result[i][j] is sample j of prompt i."""
        ...


@dataclass
class Episode:
    """One finished sample of one task, ready to become a `protocol.Sample`.

    `completion_ids` holds every token after the prompt: the model's turns and, in
    multi-turn episodes, the tool output fed back between them. `loss_mask` is 1 on the
    model's own tokens; `logprobs` is the sampler's logprob there and 0.0 elsewhere.
    """

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    finish_reason: str = ""
    # Non-empty when a tool call or the sandbox failed (the episode still counts).
    error: str = ""
    # Sandbox faults of its tool calls, in order (sandboxes.base.FAULTS).
    faults: list[str] = field(default_factory=list)
    policy_version: int = 0
    # "prompt" environments: each reward term's value (the reward is their weighted sum).
    reward_terms: dict[str, float] = field(default_factory=dict)
    # Agent episodes (OpenAI endpoint): the model calls merged into training sequences
    # (agentjet.timeline). When set, they are what is trained, not the fields above.
    sequences: list[Sequence] = field(default_factory=list)
    # With several policies: the reward of each policy the agent scored apart (`reward` is
    # its grant's policy's); a policy not named here gets `reward`.
    policy_rewards: dict[str, float] = field(default_factory=dict)

    def add_model_turn(self, completion: Completion) -> None:
        self.completion_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.loss_mask += [1] * len(completion.token_ids)
        self.turns += 1
        self.finish_reason = completion.finish_reason

    def add_context(self, token_ids: list[int]) -> None:
        """Tokens the model did not sample (tool output, next turn header): never trained."""
        self.completion_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


# An agent's or judge's reward: a number, or with several policies ([[policies]]) one per
# policy the episode called.
Reward = float | dict[str, float]


def as_reward(value: Any) -> Reward:
    """`value` as a reward: a finite number (numpy and torch scalars too, never a bool or a
    string), or a mapping of policy names to finite numbers. ValueError says what is wrong."""
    if isinstance(value, Mapping):
        if not value:
            raise ValueError("is an empty mapping")
        rewards = {}
        for name, number in value.items():
            if not isinstance(name, str):
                raise ValueError(f"names {name!r}, not a policy")
            rewards[name] = _finite(number, f"of {name!r} ")
        return rewards
    return _finite(value)


def _finite(value: Any, of: str = "") -> float:
    if isinstance(value, bool | str | bytes):
        raise ValueError(f"{of}{value!r} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{of}{value!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"{of}{value!r} is not a finite number")
    return number
