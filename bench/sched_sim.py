"""Scheduling benchmark: how many zero-variance groups does each scheduler hand out?

    world: every (env, task) has a true success rate p = sigmoid(cell base + task offset +
    what the fake policy learned); a group is 8 Bernoulli(p) rewards, and a mixed group
    teaches (its task gains TASK_LEARN_LOGIT, its cell CELL_LEARN_LOGIT)
    policy ──choose 8──▶ World.play ──GroupReport──▶ policy.observe ──▶ … (2000 groups)
    ──▶ bench/results/sched_sim.json

Calibration. Cell bases are set so the mean p per digit count is SmolLM2-135M's measured
74% / 11% / 1.5%; tasks spread around their cell by TASK_SPREAD_LOGIT, which makes uniform
sampling hand out 64% zero-variance groups, as measured in a real run; a cell gains what
the real run gained (1-digit 74% -> 95% from about 60 mixed groups: +0.03 logit each). The
per-task gain is an assumption. Two environments are mixed 3:1 (a tool-using one finds long
problems easier and costs more tokens).

Policies, all from the same world and seed: uniform (the baseline), envsched,
perfect_statistics (EnvSched's machinery fed true numbers instead of estimates: each cell's
true mean P(mixed), each seen task's true p; what better estimates could reach) and oracle
(knows every task's true p and takes the best of a pool as large as EnvSched's). Regret is
the oracle's expected number of mixed groups minus the policy's, both summed over the run.

Run: `.venv/bin/python bench/sched_sim.py` (pure Python, a few seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentjet.config import EnvConfig, EnvSchedConfig  # noqa: E402
from agentjet.protocol import GroupReport, Task  # noqa: E402
from coordinator.envsched import EnvSched, apportion, candidate_weight, cell_of  # noqa: E402
from coordinator.scheduler import Scheduler, UniformScheduler, draw_rng  # noqa: E402

GROUP_SIZE = 8
BATCH = 8
# Logit of the success rate of the median task, per environment and difficulty (with the
# spread below, arithmetic's mean p is 0.74, 0.11, 0.015 as measured), plus per op.
BASE_LOGIT = {
    "arithmetic": {1: 1.97, 2: -3.82, 3: -6.86},
    "python_tool": {1: 2.5, 2: -0.5, 3: -2.0},
}
OP_LOGIT = {"+": 0.3, "-": 0.0, "*": -0.3}
# Spread of tasks around their cell, in logits (standard deviation): within a cell, tasks
# are easy or hard, which is what makes most groups all-right or all-wrong.
TASK_SPREAD_LOGIT = 2.5
# Learning from one mixed group: the task itself, and its whole cell a little.
TASK_LEARN_LOGIT = 0.1
CELL_LEARN_LOGIT = 0.03
# Completion tokens of one sample: longer answers for longer operands, more for tool use.
TOKENS_PER_DIGIT = {"arithmetic": 4, "python_tool": 12}
ENVS = [EnvConfig(name="arithmetic", weight=3.0), EnvConfig(name="python_tool", weight=1.0)]
HELDOUT_TASKS = 600


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def mixed_chance(p: float, n: int = GROUP_SIZE) -> float:
    return 1 - p**n - (1 - p) ** n


class World:
    """True success rates, and a fake policy that improves where its groups were mixed."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.offsets: dict[tuple[str, str], float] = {}
        self.cell_skill: defaultdict[tuple[str, str, int], float] = defaultdict(float)

    def p(self, task: Task) -> float:
        key = (task.env, task.id)
        if key not in self.offsets:
            self.offsets[key] = random.Random(f"{self.seed}/{task.env}/{task.id}").gauss(
                0, TASK_SPREAD_LOGIT
            )
        logit = BASE_LOGIT[task.env][task.difficulty] + OP_LOGIT[task.op] + self.offsets[key]
        return sigmoid(logit + self.cell_skill[(task.env, task.op, task.difficulty)])

    def play(self, task: Task, rng: random.Random) -> GroupReport:
        p = self.p(task)
        rewards = [1.0 if rng.random() < p else 0.0 for _ in range(GROUP_SIZE)]
        if len(set(rewards)) > 1:
            self.offsets[(task.env, task.id)] += TASK_LEARN_LOGIT
            self.cell_skill[(task.env, task.op, task.difficulty)] += CELL_LEARN_LOGIT
        tokens = GROUP_SIZE * TOKENS_PER_DIGIT[task.env] * task.difficulty
        return GroupReport(
            node_id="sim", grant_id=task.id, rewards=rewards, completion_tokens=tokens
        )


class Oracle:
    """Knows every true p: the best tasks of a pool as large as EnvSched's, same env ratios."""

    def __init__(self, world: World, pool_factor: int) -> None:
        self.world = world
        self.pool_factor = pool_factor
        self.inner = EnvSched(ENVS, group_size=GROUP_SIZE)

    def choose(self, k: int, rng: random.Random) -> list[Task]:
        counts = apportion(k, self.inner.base_weights, {}, rng)
        tasks: list[Task] = []
        for env in sorted(counts):
            source = self.inner.sources[env][0].source
            pool = {
                t.id: t for t in (source.sample(rng) for _ in range(self.pool_factor * counts[env]))
            }
            ranked = sorted(pool.values(), key=lambda t: -mixed_chance(self.world.p(t)))
            tasks += ranked[: counts[env]]
        return tasks


class PerfectStatistics(EnvSched):
    """EnvSched choosing with true numbers instead of estimates: a task it has seen is scored
    by its true P(mixed), a fresh one by the true mean P(mixed) of its cell. The gap between
    this and the oracle is what no cell-level statistics can close."""

    def __init__(self, world: World, seed: int) -> None:
        super().__init__(ENVS, group_size=GROUP_SIZE, seed=seed)
        self.world = world
        self.cell_means: dict[tuple[str, str, int], float] = {}
        rng = random.Random(f"{seed}/cells")
        self.cell_tasks: dict[tuple[str, str, int], list[Task]] = {}
        for env, sources in self.sources.items():
            source = sources[0].source
            while min((len(v) for k, v in self.cell_tasks.items() if k[0] == env), default=0) < 100:
                task = source.sample(rng)
                self.cell_tasks.setdefault((env, task.op, task.difficulty), []).append(task)

    def observe(self, task: Task, report: GroupReport) -> None:
        super().observe(task, report)
        self.cell_means.clear()  # the world has learned

    def score(self, task: Task) -> float:
        if (cell_of(task), task.id) in self.statistics.tasks:
            mixed = mixed_chance(self.world.p(task))
        else:
            cell = (task.env, task.op, task.difficulty)
            if cell not in self.cell_means:
                tasks = self.cell_tasks[cell]
                self.cell_means[cell] = sum(mixed_chance(self.world.p(t)) for t in tasks) / len(
                    tasks
                )
            mixed = self.cell_means[cell]
        return candidate_weight(mixed, 1.0, 0.0, self.params.epsilon)


POLICIES = ("uniform", "envsched", "perfect_statistics", "oracle")


def run(
    policy: str, groups: int, seed: int, params: EnvSchedConfig | None = None
) -> dict[str, Any]:
    """One run of `groups` groups under `policy`, from a fresh world."""
    world = World(seed)
    play_rng = random.Random(f"{seed}/play")
    scheduler: Scheduler | None = None
    oracle = None
    if policy == "uniform":
        scheduler = UniformScheduler(ENVS, seed)
    elif policy == "envsched":
        scheduler = EnvSched(ENVS, params, group_size=GROUP_SIZE, seed=seed)
    elif policy == "perfect_statistics":
        scheduler = PerfectStatistics(world, seed)
    else:
        oracle = Oracle(world, EnvSchedConfig().pool_factor)
    heldout = [t for env in ENVS for t in heldout_tasks(env.name, seed)]
    accuracy_before = sum(world.p(t) for t in heldout) / len(heldout)
    issued = zero_variance = 0
    expected_mixed = 0.0
    by_env: Counter[str] = Counter()
    by_difficulty: Counter[int] = Counter()
    started = time.perf_counter()
    while issued < groups:
        rng = draw_rng(seed, issued)
        if oracle is not None:
            tasks = oracle.choose(BATCH, rng)
        else:
            assert scheduler is not None
            tasks = scheduler.choose(BATCH, rng, grants_issued=issued)
        for task in tasks:
            expected_mixed += mixed_chance(world.p(task))
            report = world.play(task, play_rng)
            zero_variance += len(set(report.rewards)) == 1
            by_env[task.env] += 1
            by_difficulty[task.difficulty] += 1
            if scheduler is not None:
                scheduler.observe(task, report)
        issued += len(tasks)
    return {
        "zero_variance_frac": round(zero_variance / issued, 4),
        "expected_mixed_groups": round(expected_mixed, 1),
        "env_share": {env: round(n / issued, 4) for env, n in sorted(by_env.items())},
        "difficulty_share": {
            str(d): round(n / issued, 4) for d, n in sorted(by_difficulty.items())
        },
        "heldout_p_before": round(accuracy_before, 4),
        "heldout_p_after": round(sum(world.p(t) for t in heldout) / len(heldout), 4),
        "seconds": round(time.perf_counter() - started, 2),
    }


def heldout_tasks(env: str, seed: int) -> list[Task]:
    """Fixed tasks to read the fake policy's skill from (never granted: 3-digit ids differ)."""
    rng = random.Random(f"{seed}/heldout/{env}")
    source = EnvSched([EnvConfig(name=env)]).sources[env][0].source
    return [source.sample(rng) for _ in range(HELDOUT_TASKS // len(ENVS))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2000, help="groups granted per policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sched_sim.json")
    args = parser.parse_args()
    runs = {policy: run(policy, args.groups, args.seed) for policy in POLICIES}
    oracle_mixed = runs["oracle"]["expected_mixed_groups"]
    for policy, row in runs.items():
        row["regret"] = round(oracle_mixed - row["expected_mixed_groups"], 1)
        print(
            f"{policy:18s} zero-variance {row['zero_variance_frac']:.3f}  "
            f"regret {row['regret']:7.1f}  held-out p {row['heldout_p_before']:.3f} -> "
            f"{row['heldout_p_after']:.3f}  ({row['seconds']:.1f} s)"
        )
    results = {**runs, "groups": args.groups, "seed": args.seed, "group_size": GROUP_SIZE}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    ratio = runs["envsched"]["zero_variance_frac"] / runs["uniform"]["zero_variance_frac"]
    print(f"zero-variance groups, envsched / uniform: {ratio:.2f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
