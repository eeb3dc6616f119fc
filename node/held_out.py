"""Held-out evaluation during training (`rollout.eval_every`, each env's `eval_file`, or a
verifiers environment's `verifiers_eval_args` set, or a "reasoning_gym" env's held-out rows:
agentjet/tasks.py `held_out_tasks`).

    rollout node: version v loaded ──HeldOut.due(v)?──▶ every env with held-out tasks:
        greedy, one answer per held-out task, played by the environment that trains it
        ──▶ one metrics row {"event": "eval", "policy_version": v,
                            "eval/<env>/accuracy", "eval/<env>/mean_reward", ...}

Version 0 (the weights before training) is evaluated first, then every `eval_every`
versions (a version that skips past a multiple counts for it). Its episodes are never
trained. In a swarm every rollout node with the setting evaluates the versions it loads.
Accuracy is the share of tasks answered right (a reward of at least 1), as `agentjet eval`
reports it (node/evaluate.py); the mean reward shows graded rewards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from agentjet.config import Config
from agentjet.episode import Generator, SamplingParams
from agentjet.protocol import Task
from agentjet.tasks import held_out_tasks
from node.agents import AgentEnv
from node.evaluate import play_rewards, summarize
from sandboxes.envs import Environment

log = logging.getLogger(__name__)

# Held-out tasks sent to the engine at once.
EVAL_BATCH = 64


class HeldOut:
    """The held-out tasks of a rollout node's environments, and when to score them."""

    def __init__(self, config: Config) -> None:
        """Reads every env's held-out tasks now: a bad file fails the node at start."""
        self.every = config.rollout.eval_every
        self.tasks: dict[str, list[Task]] = {}
        if self.every:
            for env in config.envs:
                if tasks := held_out_tasks(env):
                    self.tasks[env.name] = tasks
        if self.every and not self.tasks:
            log.warning("rollout.eval_every is set but no environment has held-out tasks "
                        "(an eval_file, verifiers_eval_args or a reasoning_gym entry)")  # fmt: skip
        self.params = SamplingParams(
            max_new_tokens=config.rollout.sampling.max_new_tokens, greedy=True
        )
        self.last: int | None = None  # the last version evaluated

    def due(self, version: int) -> bool:
        if not self.tasks:
            return False
        if self.last is None:
            return True
        return version // self.every > self.last // self.every

    async def run(
        self, envs: Mapping[str, Environment | AgentEnv], engine: Generator
    ) -> dict[str, Any]:
        """Score the loaded version on every held-out set; the metrics row."""
        version = engine.policy_version
        self.last = version
        row: dict[str, Any] = {"event": "eval", "policy_version": version}
        start = time.perf_counter()
        for name, tasks in self.tasks.items():
            rewards = await play_rewards(envs[name], engine, tasks, 1, self.params, EVAL_BATCH)
            summary = summarize(tasks, rewards, 1)
            row[f"eval/{name}/accuracy"] = summary["overall"]
            row[f"eval/{name}/mean_reward"] = summary["mean_reward"]
            row[f"eval/{name}/tasks"] = len(tasks)
            if name == "reasoning_gym":  # each dataset's accuracy (its op)
                row |= {f"eval/{name}/{op}/accuracy": a for op, a in summary["by_op"].items()}
            accuracy, mean_reward = summary["overall"], summary["mean_reward"]
            log.info("held-out %s at version %d: accuracy %.3f, mean reward %.3f (%d tasks)",
                     name, version, accuracy, mean_reward, len(tasks))  # fmt: skip
        row["eval/seconds"] = round(time.perf_counter() - start, 2)
        return row
