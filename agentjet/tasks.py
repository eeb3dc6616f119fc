"""Task sources: generated tasks of every built-in environment, and task files.

Pure and torch-free, so the coordinator (which hands tasks out) can import it. Task files
(any row shape, JSONL, JSON, CSV, Parquet or a `datasets` folder) are read by
agentjet/task_files.py; reasoning-gym's rows are made by agentjet/reasoning_gym_tasks.py.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agentjet.protocol import Task
from agentjet.reasoning_gym_tasks import GymTasks
from agentjet.sandbox_tasks import TASK_MAKERS as SANDBOX_TASK_MAKERS
from agentjet.task_files import DEFAULT_COLUMNS, BadRows, TaskColumns, load_tasks, task_row

if TYPE_CHECKING:
    from agentjet.config import EnvConfig

OPS = ("+", "-", "*")


def arithmetic_prompt(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}? Answer with just the number."


def make_arithmetic_task(rng: random.Random, difficulty: int, op: str, env: str) -> Task:
    """An `op` problem whose operands both have `difficulty` digits (1-digit includes 0)."""
    low = 0 if difficulty == 1 else 10 ** (difficulty - 1)
    high = 10**difficulty - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    if op == "-" and b > a:
        a, b = b, a  # non-negative results keep the three ops comparable in difficulty
    return arithmetic_task(a, op, b, difficulty, env)


def arithmetic_task(a: int, op: str, b: int, difficulty: int, env: str) -> Task:
    """The generated task `a op b`; its id, "d{difficulty}:{a}{op}{b}", rebuilds it
    (`arithmetic_task_from_id`)."""
    return Task(
        id=f"d{difficulty}:{a}{op}{b}",
        env=env,
        prompt=arithmetic_prompt(a, op, b),
        answer={"+": a + b, "-": a - b, "*": a * b}[op],
        op=op,
        difficulty=difficulty,
    )


# Generated arithmetic task ids; operands have at most 3 digits (EnvConfig.difficulties).
_ARITHMETIC_ID = re.compile(r"d([1-3]):(\d{1,3})([-+*])(\d{1,3})")


def arithmetic_task_from_id(task_id: str, env: str) -> Task | None:
    """The generated arithmetic task with this id, or None when the id is not one."""
    match = _ARITHMETIC_ID.fullmatch(task_id)
    if match is None:
        return None
    difficulty, a, op, b = match.groups()
    return arithmetic_task(int(a), op, int(b), int(difficulty), env)


# Reset seeds of generated OpenEnv tasks (OpenEnv's ResetRequest takes seeds >= 0).
SEED_RANGE = 2**31


def make_seed_task(rng: random.Random, difficulty: int, env: str = "openenv") -> Task:
    """A generated task of a server-side environment (OpenEnv): only a reset seed, which
    its id "seed:N" carries and its fields hold (the reset's keyword arguments); the
    prompt names it, the model never sees it (the server's observations are the turns)."""
    seed = rng.randrange(SEED_RANGE)
    return Task(
        id=f"seed:{seed}",
        env=env,
        prompt=f"{env} episode reset with seed {seed}",
        difficulty=difficulty,
        fields={"seed": seed},
    )


# Generated tasks of the environments other than arithmetic ones: (rng, difficulty, env).
TASK_MAKERS = {**SANDBOX_TASK_MAKERS, "openenv": make_seed_task}


class TaskSource:
    """Draws tasks for one environment: generated on the fly (by reasoning-gym for
    "reasoning_gym" environments, `gym`), or uniformly from a file."""

    def __init__(
        self,
        env: str,
        difficulties: Sequence[int] = (1, 2, 3),
        ops: Sequence[str] = OPS,
        task_file: str = "",
        columns: TaskColumns = DEFAULT_COLUMNS,
        bad_rows: BadRows = "stop",
        split: str = "",
        gym: GymTasks | None = None,
    ) -> None:
        self.env = env
        self.gym = gym
        self.difficulties = list(difficulties)
        self.ops = list(ops)
        self.rows: list[Task] | None = None
        self.skipped = 0  # bad rows of the task file left out (bad_rows = "skip")
        if task_file:
            loaded = load_tasks(task_file, env, columns, bad_rows, split)
            self.rows, self.skipped = loaded.tasks, len(loaded.skipped)
        self.by_id = None if self.rows is None else {task.id: task for task in self.rows}

    @classmethod
    def from_config(cls, env: EnvConfig) -> TaskSource:
        """The source an `[[envs]]` entry describes."""
        if env.name == "verifiers":  # the rows of the environment's own taskset
            from agentjet.verifiers_envs import VerifiersTaskset

            return cls.of_rows(env.name, VerifiersTaskset.of(env).tasks())
        return cls(
            env.name,
            env.difficulties,
            env.ops,
            env.task_file,
            env.columns(),
            env.bad_rows,
            env.task_split,
            GymTasks.from_config(env)
            if env.name == "reasoning_gym" and not env.task_file
            else None,
        )

    @classmethod
    def of_rows(cls, env: str, rows: Sequence[Task]) -> TaskSource:
        """A source drawing uniformly from `rows` (distinct ids)."""
        source = cls(env)
        source.rows = list(rows)
        source.by_id = {task.id: task for task in source.rows}
        return source

    def covers(self, task: Task) -> bool:
        """Whether this source could have drawn `task` (for tasks of an older config)."""
        if self.by_id is not None:
            return task.id in self.by_id
        if self.gym is not None:
            return self.gym.covers(task)
        if task.difficulty not in self.difficulties:
            return False
        return self.env in TASK_MAKERS or task.op in self.ops

    def find(self, task_id: str) -> Task | None:
        """The task with this id this source could have drawn, or None; generated tasks of
        sandboxed environments are not rebuilt from their ids."""
        if self.by_id is not None:
            return self.by_id.get(task_id)
        if self.gym is not None:
            return self.gym.find(task_id)
        if self.env in TASK_MAKERS:
            return None
        task = arithmetic_task_from_id(task_id, self.env)
        return task if task is not None and self.covers(task) else None

    def sample(self, rng: random.Random) -> Task:
        """A task: a row of the task file, or a generated one of a configured difficulty."""
        if self.rows is not None:
            return rng.choice(self.rows)
        if self.gym is not None:
            return self.gym.sample(rng)
        difficulty = rng.choice(self.difficulties)
        maker = TASK_MAKERS.get(self.env)
        if maker is not None:
            return maker(rng, difficulty, self.env)
        return make_arithmetic_task(rng, difficulty, rng.choice(self.ops), self.env)


def held_out_tasks(env: EnvConfig) -> list[Task]:
    """An `[[envs]]` entry's held-out tasks: its eval_file's, a verifiers environment's
    eval set (verifiers_eval_args), or for a "reasoning_gym" one the rows its training
    never draws (GymTasks.held_out); [] when it has none."""
    if env.eval_file:
        return load_tasks(
            env.eval_file, env.name, env.columns(), env.bad_rows, env.task_split
        ).tasks
    if env.name == "verifiers" and env.verifiers_eval_args:
        from agentjet.verifiers_envs import VerifiersTaskset

        return VerifiersTaskset.of(env).eval_tasks()
    if env.name == "reasoning_gym":
        return GymTasks.from_config(env).held_out()
    return []


def draw_tasks(
    rng: random.Random, sources: Sequence[TaskSource], weights: Sequence[float], k: int
) -> list[Task]:
    """`k` tasks, each from a source picked by weight: the uniform baseline's choice (the
    coordinator's UniformScheduler, and a rollout node's fallback while it is away)."""
    return [source.sample(rng) for source in rng.choices(sources, weights=weights, k=k)]


def generate_tasks(
    count: int,
    seed: int,
    difficulties: Sequence[int] = (1, 2, 3),
    ops: Sequence[str] = OPS,
    env: str = "arithmetic",
) -> list[Task]:
    """`count` tasks of `env` balanced over difficulty (and op, for arithmetic environments),
    distinct ids, reproducible by seed."""
    rng = random.Random(seed)
    maker = TASK_MAKERS.get(env)
    tasks: dict[str, Task] = {}
    cells = [(d, op) for d in difficulties for op in (ops if maker is None else [""])]
    attempts = 0
    while len(tasks) < count:
        d, op = cells[len(tasks) % len(cells)]
        task = make_arithmetic_task(rng, d, op, env) if maker is None else maker(rng, d, env)
        attempts += 1
        if attempts > 100 * count:
            raise ValueError(
                f"cannot make {count} distinct {env} tasks of difficulties "
                f"{list(difficulties)}: {len(tasks)} found in {attempts - 1} draws; ask for fewer"
            )
        tasks.setdefault(task.id, task)
    return list(tasks.values())


def write_task_file(tasks: Sequence[Task], path: str | Path) -> None:
    """`tasks` as a JSONL task file (`load_tasks` reads them back as they were)."""
    with open(path, "w") as f:
        for task in tasks:
            f.write(json.dumps(task_row(task)) + "\n")
