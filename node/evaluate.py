"""`agentjet eval`: greedy accuracy of a checkpoint (or the base model) on a task file.

    task file ──▶ environment.run_group(engine, tasks, n=1, greedy) ──▶ rewards
              ──▶ {"overall": acc, "by_difficulty": {"1": acc, ...}, "by_op": {...}, "n": N}

The same environment code that plays training episodes scores evaluation ones, so the
numbers mean the same thing in both places.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from agentjet.config import AGENT_ENVS, SANDBOXED_ENVS, Config, EnvConfig
from agentjet.episode import SamplingParams
from agentjet.errors import ModelError
from agentjet.tasks import load_task_file
from node.agents import make_agent_env
from node.model import resolve_model
from node.torch_engine import TorchEngine
from sandboxes.envs import make_env
from sandboxes.pool import open_pool
from sandboxes.process import ProcessSandbox


def evaluate_checkpoint(
    config: Config, checkpoint: str, tasks_path: Path, env_name: str, batch_size: int = 64
) -> dict[str, Any]:
    if checkpoint == "base":
        path = resolve_model(config.model.name, config.model.cache_dir)
    else:
        path = Path(checkpoint).expanduser()
        if not (path / "config.json").is_file():
            raise ModelError(f"{checkpoint} is not a checkpoint folder (no config.json)")
    tasks = load_task_file(tasks_path, env=env_name)
    env_config = next((e for e in config.envs if e.name == env_name), EnvConfig(name=env_name))
    engine = TorchEngine(path, dtype=config.model.dtype, seed=config.run.seed)
    params = SamplingParams(max_new_tokens=config.rollout.sampling.max_new_tokens, greedy=True)
    start = time.perf_counter()
    rewards: list[float] = []
    with contextlib.ExitStack() as cleanup:
        pool = None
        if env_name in SANDBOXED_ENVS:
            pool = open_pool(config.sandbox, f"eval-{os.getpid()}")
            cleanup.callback(pool.close)
        if env_name in AGENT_ENVS:
            factory = ProcessSandbox if pool is None else pool.lease
            agent_env = make_agent_env(env_config, config.rollout, factory)
            cleanup.callback(agent_env.close)
            for i in range(0, len(tasks), batch_size):
                chunk = tasks[i : i + batch_size]
                played = agent_env.play(engine, chunk, 1, params, training=False)
                rewards += [group[0].reward if group else 0.0 for group in played]
        else:
            env = make_env(env_config, pool)
            for i in range(0, len(tasks), batch_size):
                chunk = tasks[i : i + batch_size]
                episodes = env.run_group(engine, chunk, 1, params)
                rewards += [eps[0].reward for eps in episodes]
    return summarize(tasks, rewards) | {
        "checkpoint": checkpoint,
        "env": env_name,
        "seconds": round(time.perf_counter() - start, 1),
    }


def summarize(tasks: list[Any], rewards: list[float]) -> dict[str, Any]:
    """Accuracy overall, per difficulty and per op (a reward of 1 counts as right)."""
    by_difficulty: defaultdict[str, list[float]] = defaultdict(list)
    by_op: defaultdict[str, list[float]] = defaultdict(list)
    for task, reward in zip(tasks, rewards, strict=True):
        right = 1.0 if reward >= 1.0 else 0.0
        if task.difficulty:
            by_difficulty[str(task.difficulty)].append(right)
        if task.op:
            by_op[task.op].append(right)

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 4) if xs else 0.0

    return {
        "overall": mean([1.0 if r >= 1.0 else 0.0 for r in rewards]),
        "by_difficulty": {k: mean(v) for k, v in sorted(by_difficulty.items())},
        "by_op": {k: mean(v) for k, v in sorted(by_op.items())},
        "n": len(rewards),
    }
