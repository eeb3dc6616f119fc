"""Built-in environments: what an episode is, how it is played, how it is scored.

    rollout node ── await run_group(generator, tasks, n, params) ──▶ Environment ──▶ n Episodes
                                                                       │       per task
                                                  await Generator.generate (one call per turn)

`run_group` is a coroutine on the caller's event loop (the rollout node's, or the one
`agentjet eval` runs); blocking work (sandbox programs, the engine's compute) crosses the
one bridge to a thread (agentjet/bridge.py). It never raises for what the model or its
programs do wrong: a wrong answer is reward 0, a tool fault is reward 0 and an
`Episode.error`. Engine failures propagate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from agentjet.config import ENV_NAMES, EnvConfig
from agentjet.episode import Episode, Generator, SamplingParams
from agentjet.errors import ConfigError
from agentjet.protocol import Task
from agentjet.reasoning_gym_tasks import GymTasks, system_prompt
from sandboxes.base import Sandbox
from sandboxes.envs.arithmetic import ArithmeticEnv
from sandboxes.envs.prompt import PromptEnv, Rewards
from sandboxes.envs.python_code import PythonCodeEnv
from sandboxes.envs.python_tool import PythonToolEnv
from sandboxes.envs.reasoning_gym import ReasoningGymEnv
from sandboxes.envs.sandboxed import MAX_EPISODES_AT_ONCE, SandboxedEnv
from sandboxes.envs.shell import ShellEnv
from sandboxes.pool import SandboxPool
from sandboxes.process import ProcessSandbox

__all__ = [
    "ArithmeticEnv",
    "Environment",
    "PromptEnv",
    "PythonCodeEnv",
    "PythonToolEnv",
    "ReasoningGymEnv",
    "ShellEnv",
    "make_env",
]

_SANDBOXED: dict[str, type[SandboxedEnv]] = {
    "python_tool": PythonToolEnv,
    "python_code": PythonCodeEnv,
    "shell": ShellEnv,
}


class Environment(Protocol):
    """Plays and scores episodes of its tasks with a given engine."""

    name: str

    async def run_group(
        self, generator: Generator, tasks: list[Task], n: int, params: SamplingParams
    ) -> list[list[Episode]]:
        """`n` finished episodes for each task: result[i][j] is sample j of tasks[i].

        All episodes' model calls of one turn go to the engine as one batch.
        """
        ...


def make_env(config: EnvConfig, pool: SandboxPool | None = None) -> Environment:
    """The environment an `[[envs]]` config entry names. Sandboxed ones lease each
    episode's sandbox from `pool` (at most its size at once); without one, each episode
    gets a fresh ProcessSandbox."""
    if config.name == "arithmetic":
        return ArithmeticEnv(partial_credit=config.partial_credit)
    if config.name == "prompt":
        sandboxes: Callable[[], Sandbox] = ProcessSandbox if pool is None else pool.lease
        return PromptEnv(Rewards.from_config(config, sandboxes))
    if config.name == "reasoning_gym":
        return ReasoningGymEnv(GymTasks.from_config(config), system_prompt(config.rg_system_prompt))
    if config.name in _SANDBOXED:
        factory = ProcessSandbox if pool is None else pool.lease
        return _SANDBOXED[config.name](
            max_turns=config.max_turns,
            tool_timeout_s=config.tool_timeout_s,
            sandbox_factory=factory,
            max_episodes_at_once=MAX_EPISODES_AT_ONCE if pool is None else pool.size,
        )
    raise ConfigError(f"unknown environment {config.name!r} (allowed: {', '.join(ENV_NAMES)})")
