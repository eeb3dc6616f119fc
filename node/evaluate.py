"""`agentjet eval`: accuracy of a checkpoint (or the base model) on a task file, or on the
held-out rows of a "reasoning_gym" environment (no file: agentjet/tasks.py held_out_tasks).

    task file ──▶ await environment.run_group(engine, tasks, n, params) ──▶ rewards
              ──▶ per task: the share of its n answers that are right
              ──▶ {"overall": acc, "by_difficulty": {"1": acc, ...}, "by_op": {...}, "n": N}

The sandbox pool and the environment (its reward functions imported) are made first, so a
reward that cannot load is refused before the model does; then the engine, on
`rollout.torch_threads` threads as a rollout node runs it (torch's default, every core,
collapsed throughput 6x on a busy 2-core box: bench/eval_speed.py); then every chunk of
tasks is played in one event loop (uvloop), as a rollout node plays them: an agent
environment's endpoint is started on that loop and closed on it before it ends. Tasks
done / total and their rate go to stderr as each chunk ends (a bar on a terminal, a line
every few seconds otherwise; agentjet/progress.py), so the JSON on stdout stays clean.

By default one greedy answer per task. With `samples` > 0, that many answers per task are
sampled as rollouts sample them (`rollout.sampling`: temperature, top-p), so the figure is
the policy's expected success, the quantity RL training raises. The two differ (docs/guide-data.md,
"Evaluate a checkpoint").

`show` > 0 prints the first `show` tasks with every answer and the reward it scored to
stderr (node/eval_show.py). The summary's `cut_at_max_new_tokens` is the share of answers
that hit `rollout.sampling.max_new_tokens` (single-turn environments): near 1, the score
says more about the limit than about the model.

The same environment code that plays training episodes scores evaluation ones, so the
numbers mean the same thing in both places.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import uvloop

from agentjet.config import AGENT_ENVS, Config, EnvConfig
from agentjet.episode import Generator, SamplingParams
from agentjet.errors import ConfigError, ModelError
from agentjet.progress import ProgressReport
from agentjet.protocol import Task
from agentjet.task_files import load_tasks
from agentjet.tasks import held_out_tasks
from node.agents import AgentEnv, make_agent_env
from node.engine import open_engine
from node.eval_show import Seen, format_samples
from node.model import resolve_model
from sandboxes.envs import Environment, make_env
from sandboxes.pool import open_pool
from sandboxes.process import ProcessSandbox


def evaluate_checkpoint(
    config: Config,
    checkpoint: str,
    tasks_path: Path | None,
    env_name: str,
    batch_size: int = 64,
    samples: int = 0,
    show: int = 0,
) -> dict[str, Any]:
    """Accuracy on the task file (None: the entry's held-out tasks, agentjet/tasks.py
    `held_out_tasks`): greedy (`samples` 0), or the mean of `samples` sampled answers per
    task; `batch_size` answers go to the engine at once. The file is read with
    the `[[envs]]` entry of that name (its columns, split, reward), if the config has one.
    `show`: print the first `show` tasks with their answers and rewards to stderr."""
    # The base model is found (maybe downloaded) once everything else is known good.
    path = None if checkpoint == "base" else checkpoint_folder(checkpoint)
    env_config = next((e for e in config.envs if e.name == env_name), EnvConfig(name=env_name))
    tasks = eval_tasks(env_config, tasks_path)
    sampling = config.rollout.sampling
    params = SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens,
        greedy=samples == 0,
    )
    n = samples or 1
    seen = Seen(show)
    with contextlib.ExitStack() as cleanup:
        pool = None
        if env_config.sandboxed():
            pool = open_pool(config.sandbox, f"eval-{os.getpid()}")
            cleanup.callback(pool.close)
        # Made before the model is found (maybe downloaded) and loaded, so a reward function
        # that cannot load fails in one line at once. Agent environments start their
        # endpoint on the loop.
        env = None if env_name in AGENT_ENVS else make_env(env_config, pool)
        torch.set_num_threads(config.rollout.torch_threads)
        engine = open_engine(
            config.model,
            config.rollout,
            path or resolve_model(config.model.name, config.model.cache_dir),
            config.run.seed,
        )
        cleanup.callback(engine.close)
        start = time.perf_counter()

        async def play_all(played: Callable[[int], object]) -> list[list[float]]:
            playing: Environment | AgentEnv
            if env is None:
                factory = ProcessSandbox if pool is None else pool.lease
                playing = make_agent_env(env_config, config.rollout, factory)
            else:
                playing = env
            try:
                chunk_size = max(1, batch_size // n)
                return await play_rewards(
                    playing, engine, tasks, n, params, chunk_size, played, seen
                )
            finally:
                if isinstance(playing, AgentEnv):
                    await playing.close()

        with ProgressReport(f"eval {env_name}", len(tasks), "tasks") as report:
            rewards = uvloop.run(play_all(report.update))
        if seen.shown:
            decode = partial(engine.tokenizer.decode, skip_special_tokens=True)
            print(format_samples(seen.shown, decode, params.max_new_tokens), file=sys.stderr)
    summary = summarize(tasks, rewards, n) | {
        "decoding": decoding(env_name, samples, sampling.temperature),
        "checkpoint": checkpoint,
        "env": env_name,
        "seconds": round(time.perf_counter() - start, 1),
    }
    if seen.cut.total():
        summary["cut_at_max_new_tokens"] = round(seen.cut[True] / seen.cut.total(), 4)
    return summary


def eval_tasks(env: EnvConfig, tasks_path: Path | None) -> list[Task]:
    """The tasks of the file, read as the entry reads its task_file; without one, the
    entry's own held-out tasks (agentjet/tasks.py `held_out_tasks`)."""
    if tasks_path is not None:
        return load_tasks(tasks_path, env.name, env.columns(), env.bad_rows, env.task_split).tasks
    if not (tasks := held_out_tasks(env)):
        raise ConfigError(
            f"agentjet eval --env {env.name}: give --tasks FILE (the config's entry for "
            f"{env.name!r} has no held-out tasks)"
        )
    return tasks


def checkpoint_folder(checkpoint: str) -> Path:
    """The folder of a checkpoint to evaluate; ModelError for one that is no checkpoint."""
    path = Path(checkpoint).expanduser()
    if not (path / "config.json").is_file():
        raise ModelError(f"{checkpoint} is not a checkpoint folder (no config.json)")
    return path


async def play_rewards(
    env: Environment | AgentEnv,
    engine: Generator,
    tasks: Sequence[Task],
    n: int,
    params: SamplingParams,
    chunk_size: int,
    played: Callable[[int], object] | None = None,
    seen: Callable[[Sequence[Task], Sequence[Sequence[Any]]], object] | None = None,
) -> list[list[float]]:
    """Per task, the rewards of its answers (fewer than `n` when some failed to play),
    `chunk_size` tasks at a time; evaluation episodes, never trained. `played` is told how
    many tasks each chunk held once it is done (a progress report's `update`), `seen` each
    chunk's tasks and their episodes."""
    play: Callable[[list[Task]], Awaitable[Sequence[Sequence[Any]]]]
    if isinstance(env, AgentEnv):  # agents sample as they are configured
        play = partial(env.play, engine, n=n, params=params, training=False)
    else:
        play = partial(env.run_group, engine, n=n, params=params)
    rewards: list[list[float]] = []
    for i in range(0, len(tasks), chunk_size):
        chunk = tasks[i : i + chunk_size]
        episodes = await play(list(chunk))
        rewards += [[e.reward for e in task_episodes] for task_episodes in episodes]
        if seen is not None:
            seen(chunk, episodes)
        if played is not None:
            played(len(episodes))
    return rewards


def decoding(env_name: str, samples: int, temperature: float) -> str:
    """How the answers were produced, in words (agents sample as they are configured)."""
    if env_name in AGENT_ENVS:
        return f"{samples or 1} per task, sampled as the agent is configured"
    return f"{samples} per task, sampled at temperature {temperature}" if samples else "greedy"


def success(rewards: list[float], n: int) -> float:
    """The share of a task's `n` answers that are right (a reward of 1); an answer that
    failed to play (no episode) counts as wrong."""
    return sum(1.0 for r in rewards if r >= 1.0) / n


def summarize(tasks: Sequence[Task], rewards: list[list[float]], n: int) -> dict[str, Any]:
    """Accuracy overall, per difficulty and per op (the mean of the tasks' success shares),
    and the mean reward (failed answers count 0): what a graded reward shows."""
    successes = [success(task_rewards, n) for task_rewards in rewards]
    by_difficulty: defaultdict[str, list[float]] = defaultdict(list)
    by_op: defaultdict[str, list[float]] = defaultdict(list)
    for task, right in zip(tasks, successes, strict=True):
        if task.difficulty:
            by_difficulty[str(task.difficulty)].append(right)
        if task.op:
            by_op[task.op].append(right)

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 4) if xs else 0.0

    return {
        "overall": mean(successes),
        "mean_reward": mean([sum(r) / n for r in rewards]),
        "by_difficulty": {k: mean(v) for k, v in sorted(by_difficulty.items())},
        "by_op": {k: mean(v) for k, v in sorted(by_op.items())},
        "n": len(successes),
    }
