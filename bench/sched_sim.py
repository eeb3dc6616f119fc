"""Scheduling benchmark: how many zero-variance groups does each scheduler hand out, and
which groups does the trainer get?

    world: every (env, task) has a true success rate p = sigmoid(cell base + task offset +
    what the fake policy learned + drift); a group is 8 Bernoulli(p) rewards, a mixed group
    teaches (its task gains TASK_LEARN_LOGIT, its cell CELL_LEARN_LOGIT), and every group
    played moves every task by DRIFT_LOGIT_PER_GROUP (the policy improves everywhere)
    policy ──choose 8──▶ World.play ──GroupReport──▶ policy.observe ──▶ … (2000 groups)
    ──▶ zero-variance share, mixed groups per group, trained mix (envsched_status.cell_mix), keep
    ──▶ bench/results/sched_sim.json

Calibration. Cell bases are set so the mean p per digit count is SmolLM2-135M's measured
74% / 11% / 1.5%; tasks spread around their cell by TASK_SPREAD_LOGIT, which makes uniform
sampling hand out 64% zero-variance groups, as measured in a real run; a cell gains what
the real run gained (1-digit 74% -> 95% from about 60 mixed groups: +0.03 logit each). The
per-task gain and the drift are assumptions. Two environments are mixed 3:1 (a tool-using
one finds long problems easier and costs more tokens).

Policies, all from the same world and seed: uniform (the baseline), envsched,
perfect_statistics (EnvSched's machinery fed true numbers instead of estimates: each cell's
true mean P(mixed), each seen task's true p; what better estimates could reach) and oracle
(knows every task's true p and takes the best of a pool as large as EnvSched's). Regret is
the oracle's expected number of mixed groups minus the policy's, both summed over the run.
The trained mix is what the trainer would get: mixed groups per environment and difficulty.
EnvSched steers each environment's zero-variance share toward `zero_variance_target`; the
second half of the run shows where it settles.

Run: `.venv/bin/python bench/sched_sim.py` (pure Python, a few seconds).

`--sweep-steer 0.05,0.2,1.0 --seeds 0,1,2,3,4 --groups-list 130,300` instead runs uniform and
EnvSched at each `steer_rate` (and `--target`, `--floor`) for runs as short as the
benchmark's 5-minute arms (about 130 reported groups), and writes the mean zero-variance
share of each to bench/results/sched_sim_steer.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentjet.config import EnvConfig, EnvSchedConfig  # noqa: E402
from agentjet.protocol import GroupReport, Task  # noqa: E402
from coordinator.envsched import (  # noqa: E402
    EnvSched,
    apportion,
    candidate_weight,
    cell_of,
)
from coordinator.envsched_status import cell_mix  # noqa: E402
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
# Every task's logit rises this much per group played, whatever was trained: +1 logit over
# a run of 2000 groups, so the zero-variance share uniform sampling gives moves under
# EnvSched's steering (1-digit problems drift toward always right, 3-digit out of reach).
DRIFT_LOGIT_PER_GROUP = 0.0005
# Completion tokens of one sample: longer answers for longer operands, more for tool use.
TOKENS_PER_DIGIT = {"arithmetic": 4, "python_tool": 12}
ENVS = [EnvConfig(name="arithmetic", weight=3.0), EnvConfig(name="python_tool", weight=1.0)]
HELDOUT_TASKS = 600


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def mixed_chance(p: float, n: int = GROUP_SIZE) -> float:
    return 1 - p**n - (1 - p) ** n


class World:
    """True success rates, and a fake policy that improves where its groups were mixed and
    drifts everywhere."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.drift = 0.0  # logit added to every task so far
        self.offsets: dict[tuple[str, str], float] = {}
        self.cell_skill: defaultdict[tuple[str, str, int], float] = defaultdict(float)

    def p(self, task: Task) -> float:
        key = (task.env, task.id)
        if key not in self.offsets:
            self.offsets[key] = random.Random(f"{self.seed}/{task.env}/{task.id}").gauss(
                0, TASK_SPREAD_LOGIT
            )
        logit = BASE_LOGIT[task.env][task.difficulty] + OP_LOGIT[task.op] + self.offsets[key]
        return sigmoid(logit + self.cell_skill[(task.env, task.op, task.difficulty)] + self.drift)

    def play(self, task: Task, rng: random.Random) -> GroupReport:
        p = self.p(task)
        rewards = [1.0 if rng.random() < p else 0.0 for _ in range(GROUP_SIZE)]
        if len(set(rewards)) > 1:
            self.offsets[(task.env, task.id)] += TASK_LEARN_LOGIT
            self.cell_skill[(task.env, task.op, task.difficulty)] += CELL_LEARN_LOGIT
        self.drift += DRIFT_LOGIT_PER_GROUP
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

    def weight(self, task: Task) -> float:
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
        keep = self.statistics.keep_rate(task.env)
        return candidate_weight(mixed, keep, self.params.floor)


POLICIES = ("uniform", "envsched", "perfect_statistics", "oracle")


class Played(NamedTuple):
    """One simulated run: what was granted and reported, in order, and how it went."""

    reports: list[tuple[Task, GroupReport]]
    expected_mixed: float  # Σ over the grants of the true P(mixed) when granted
    heldout_p_before: float
    heldout_p_after: float
    keep: dict[str, float]  # EnvSched's keep rate per env at the end ({} for the others)
    seconds: float


def simulate(
    policy: str,
    groups: int,
    seed: int,
    params: EnvSchedConfig | None = None,
) -> Played:
    """`groups` groups under `policy`, from a fresh world."""
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
    reports: list[tuple[Task, GroupReport]] = []
    expected_mixed = 0.0
    started = time.perf_counter()
    while len(reports) < groups:
        rng = draw_rng(seed, len(reports))
        if oracle is not None:
            tasks = oracle.choose(BATCH, rng)
        else:
            assert scheduler is not None
            tasks = scheduler.choose(BATCH, rng, grants_issued=len(reports))
        for task in tasks:
            expected_mixed += mixed_chance(world.p(task))
            report = world.play(task, play_rng)
            reports.append((task, report))
            if scheduler is not None:
                scheduler.observe(task, report)
    keep = (
        dict(sorted(scheduler.statistics.keep.items())) if isinstance(scheduler, EnvSched) else {}
    )
    return Played(
        reports,
        expected_mixed,
        accuracy_before,
        sum(world.p(t) for t in heldout) / len(heldout),
        keep,
        time.perf_counter() - started,
    )


def zero_variance_share(reports: Sequence[tuple[Task, GroupReport]]) -> float:
    """The share of groups whose rewards all agree."""
    return sum(len(set(report.rewards)) == 1 for _, report in reports) / max(len(reports), 1)


def summary(played: Played) -> dict[str, Any]:
    """The figures of one run (the second half shows where EnvSched's steering settles)."""
    reports = played.reports
    late = reports[len(reports) // 2 :]
    by_env = Counter(task.env for task, _ in reports)
    by_difficulty = Counter(task.difficulty for task, _ in reports)
    zero_variance = zero_variance_share(reports)
    return {
        "zero_variance_frac": round(zero_variance, 4),
        "zero_variance_frac_second_half": {
            env: round(zero_variance_share([r for r in late if r[0].env == env]), 4)
            for env in sorted(by_env)
        },
        "mixed_per_group": round(1 - zero_variance, 4),
        "expected_mixed_groups": round(played.expected_mixed, 1),
        "env_share": {env: round(n / len(reports), 4) for env, n in sorted(by_env.items())},
        "difficulty_share": {
            str(d): round(n / len(reports), 4) for d, n in sorted(by_difficulty.items())
        },
        "trained_mix": {
            env: {
                level: {key: round(value, 4) for key, value in row.items()}
                for level, row in levels.items()
            }
            for env, levels in cell_mix(reports).items()
        },
        **({"keep": {env: round(k, 4) for env, k in played.keep.items()}} if played.keep else {}),
        "heldout_p_before": round(played.heldout_p_before, 4),
        "heldout_p_after": round(played.heldout_p_after, 4),
        "seconds": round(played.seconds, 2),
    }


def heldout_tasks(env: str, seed: int) -> list[Task]:
    """Fixed tasks to read the fake policy's skill from (never granted: 3-digit ids differ)."""
    rng = random.Random(f"{seed}/heldout/{env}")
    source = EnvSched([EnvConfig(name=env)]).sources[env][0].source
    return [source.sample(rng) for _ in range(HELDOUT_TASKS // len(ENVS))]


def sweep_steer(args: argparse.Namespace) -> int:
    """Mean zero-variance share over seeds: uniform, and EnvSched at each steer rate."""
    rates = [float(r) for r in args.sweep_steer.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: dict[str, dict[str, float]] = {}
    for groups in (int(g) for g in args.groups_list.split(",")):
        row = {"uniform": statistics.fmean(
            zero_variance_share(simulate("uniform", groups, seed).reports) for seed in seeds
        )}  # fmt: skip
        for rate in rates:
            params = EnvSchedConfig(
                steer_rate=rate, zero_variance_target=args.target, floor=args.floor
            )
            row[f"steer {rate:g}"] = statistics.fmean(
                zero_variance_share(simulate("envsched", groups, seed, params).reports)
                for seed in seeds
            )
        rows[str(groups)] = {k: round(v, 3) for k, v in row.items()}
        print(
            f"{groups:5d} groups: "
            + "  ".join(f"{k} {v:.3f}" for k, v in rows[str(groups)].items())
        )
    out = args.out or ROOT / "bench" / "results" / "sched_sim_steer.json"
    settings = {"target": args.target, "floor": args.floor, "seeds": seeds}
    out.write_text(json.dumps({**settings, "zero_variance_frac": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2000, help="groups granted per policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="default bench/results/sched_sim[_steer].json")
    parser.add_argument("--sweep-steer", help="comma-separated steer rates (see above)")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="with --sweep-steer")
    parser.add_argument("--groups-list", default="130,300", help="with --sweep-steer")
    parser.add_argument("--target", type=float, default=EnvSchedConfig().zero_variance_target)
    parser.add_argument("--floor", type=float, default=EnvSchedConfig().floor)
    args = parser.parse_args()
    if args.sweep_steer:
        return sweep_steer(args)
    runs = {policy: summary(simulate(policy, args.groups, args.seed)) for policy in POLICIES}
    oracle_mixed = runs["oracle"]["expected_mixed_groups"]
    for policy, row in runs.items():
        row["regret"] = round(oracle_mixed - row["expected_mixed_groups"], 1)
        late = " ".join(f"{v:.2f}" for v in row["zero_variance_frac_second_half"].values())
        trained = " / ".join(
            f"{env} " + " ".join(f"{row['trained_mix'][env][d]['mixed']:g}" for d in "123")
            for env in row["trained_mix"]
        )
        print(
            f"{policy:18s} zero-variance {row['zero_variance_frac']:.3f} "
            f"(second half by env {late})  regret {row['regret']:7.1f}  "
            f"held-out p {row['heldout_p_before']:.3f} -> {row['heldout_p_after']:.3f}  "
            f"({row['seconds']:.1f} s)\n{'':18s} mixed groups by digits: {trained}"
        )
    results = {**runs, "groups": args.groups, "seed": args.seed, "group_size": GROUP_SIZE}
    out = args.out or ROOT / "bench" / "results" / "sched_sim.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    ratio = runs["envsched"]["zero_variance_frac"] / runs["uniform"]["zero_variance_frac"]
    print(f"zero-variance groups, envsched / uniform: {ratio:.2f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
