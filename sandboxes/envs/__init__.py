"""Built-in environments: what an episode is, how it is played, how it is scored.

    rollout node ── run_group(generator, tasks, n, params) ──▶ Environment ──▶ n Episodes per task
                                                                 │
                                                   Generator.generate (one call per turn)

`run_group` blocks (the rollout node calls it from a worker thread) and never raises for
what the model or its programs do wrong: a wrong answer is reward 0, a tool fault is
reward 0 and an `Episode.error`. Engine failures propagate.
"""

from __future__ import annotations

from typing import Protocol

from agentjet.config import ENV_NAMES, EnvConfig
from agentjet.episode import Episode, Generator, SamplingParams
from agentjet.errors import ConfigError
from agentjet.protocol import Task
from sandboxes.envs.arithmetic import ArithmeticEnv
from sandboxes.envs.python_tool import PythonToolEnv

__all__ = ["ArithmeticEnv", "Environment", "PythonToolEnv", "make_env"]


class Environment(Protocol):
    """Plays and scores episodes of its tasks with a given engine."""

    name: str

    def run_group(
        self, generator: Generator, tasks: list[Task], n: int, params: SamplingParams
    ) -> list[list[Episode]]:
        """`n` finished episodes for each task: result[i][j] is sample j of tasks[i].

        All episodes' model calls of one turn go to the engine as one batch.
        """
        ...


def make_env(config: EnvConfig) -> Environment:
    """The environment an `[[envs]]` config entry names."""
    if config.name == "arithmetic":
        return ArithmeticEnv()
    if config.name == "python_tool":
        return PythonToolEnv(max_turns=config.max_turns, tool_timeout_s=config.tool_timeout_s)
    raise ConfigError(f"unknown environment {config.name!r} (allowed: {', '.join(ENV_NAMES)})")
