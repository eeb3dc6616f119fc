"""EnvSched's reports: the status table `agentjet status` shows, and the granted and trained
mix by cell that the scheduling benchmarks write (the model itself: coordinator/envsched.py).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

from agentjet.protocol import GroupReport, SchedulerRow, Task
from coordinator.envsched import (
    Cell,
    Statistics,
    Sums,
    candidate_weight,
    cell_of,
    group_sums,
    mixed_probability,
    within_variance,
)

# How many cells and tasks `agentjet status` lists (best first).
STATUS_TOP_CELLS = 12
STATUS_TOP_TASKS = 6


# ── the status table ──────────────────────────────────────────────────────────────────────


def cell_name(cell: Cell) -> str:
    features = " ".join(
        part for part in (f"d{cell.difficulty}" if cell.difficulty else "", cell.op) if part
    )
    return f"{cell.env} {features or '(no features)'}"


def _observed(sums: Sums) -> tuple[float | None, float | None, float | None]:
    """Mean reward, within-group variance and mixed-group rate as reported (decayed)."""
    if sums.samples <= 0:
        return None, None, None
    mean = sums.reward / sums.samples
    variance = None
    if sums.pairs > 0:
        variance = max(0.0, sums.reward_sq / sums.samples - sums.pair_products / sums.pairs)
    return mean, variance, sums.mixed / sums.groups


def status_table(
    statistics: Statistics, recent: Sequence[Task], targets: Mapping[str, float]
) -> list[SchedulerRow]:
    """Rows for `agentjet status`: every environment, then the top cells, then the top tasks.

    Environment rows show what was observed (decayed); cell and task rows show what the model
    predicts, and a cell's score is the weight an unseen task of it gets now (at its
    environment's keep rate, which the environment's row shows). `recent`
    are the newest grants, whose shares the rows report; `targets` are the environments'
    ratio targets (normalised here).
    """
    stats, params = statistics, statistics.params
    total_target = sum(targets.values()) or 1.0
    by_env = Counter(task.env for task in recent)
    by_cell = Counter(cell_of(task) for task in recent)
    by_task = Counter((cell_of(task), task.id) for task in recent)
    share = 1.0 / len(recent) if recent else 0.0
    rows = []
    for env in sorted(set(targets) | set(stats.envs)):
        sums = stats.env_sums(env)
        mean, variance, mixed = _observed(sums)
        node = stats.envs.get(env)
        rows.append(
            SchedulerRow(
                level="env",
                name=env,
                visits=node.visits if node else 0,
                mean_reward=mean,
                variance=variance,
                mixed=mixed,
                grant_share=by_env[env] * share,
                target_share=targets.get(env, 0.0) / total_target,
                failure_rate=sums.failed / sums.reports if sums.reports else None,
                keep=stats.keep_rate(env),
            )
        )
    cells = []
    for cell, node in stats.cells.items():
        view = stats.cell_view(cell)
        mixed = mixed_probability(view.beta, stats.group_size)
        weight = candidate_weight(mixed, stats.keep_rate(cell.env), params.floor)
        cells.append((-weight, cell, node, view.beta, mixed))
    for neg_weight, cell, node, beta, mixed in sorted(cells)[:STATUS_TOP_CELLS]:
        rows.append(
            SchedulerRow(
                level="cell",
                name=cell_name(cell),
                visits=node.visits,
                mean_reward=beta.alpha / (beta.alpha + beta.beta),
                variance=within_variance(beta),
                mixed=mixed,
                grant_share=by_cell[cell] * share,
                score=-neg_weight,
            )
        )
    repeated = [(key, node) for key, node in stats.tasks.items() if node.visits > 1]
    repeated.sort(key=lambda item: (-item[1].visits, item[0]))
    for (cell, task_id), node in repeated[:STATUS_TOP_TASKS]:
        task = Task(
            id=task_id, env=cell.env, prompt="", answer=0, op=cell.op, difficulty=cell.difficulty
        )
        beta = stats.task_beta(task)
        rows.append(
            SchedulerRow(
                level="task",
                name=f"{cell.env} {task_id}",
                visits=node.visits,
                mean_reward=beta.alpha / (beta.alpha + beta.beta),
                variance=within_variance(beta),
                mixed=mixed_probability(beta, stats.group_size),
                grant_share=by_task[(cell, task_id)] * share,
            )
        )
    return rows


# ── what was granted and trained, for benchmarks ──────────────────────────────────────────


def cell_mix(reports: Iterable[tuple[Task, GroupReport]]) -> dict[str, dict[str, dict[str, float]]]:
    """Groups and mixed groups per environment and declared difficulty, from (task, report)
    pairs such as Store.accepted_reports() yields: {env: {difficulty: row, ..., "all": row}},
    difficulties as strings ("0": none declared), ready for JSON.

    A row: `groups`, the reports with rewards (failed ones train nothing and are left out);
    `mixed`, those whose rewards were not all equal (what GRPO trains on); `share`, groups
    over the environment's (for "all": over every environment's); `mixed_share`, mixed over
    the environment's mixed, the trained mix (for "all": over every environment's);
    `mixed_rate`, mixed over groups.
    """
    groups: defaultdict[str, Counter[int]] = defaultdict(Counter)
    mixed: defaultdict[str, Counter[int]] = defaultdict(Counter)
    for task, report in reports:
        sums = group_sums(report)
        if sums.groups:
            groups[task.env][task.difficulty] += 1
            mixed[task.env][task.difficulty] += int(sums.mixed)
    every_group = sum(counts.total() for counts in groups.values())
    every_mixed = sum(counts.total() for counts in mixed.values())
    mix: dict[str, dict[str, dict[str, float]]] = {}
    for env in sorted(groups):
        env_groups, env_mixed = groups[env].total(), mixed[env].total()
        mix[env] = {
            str(d): mix_row(groups[env][d], mixed[env][d], env_groups, env_mixed)
            for d in sorted(groups[env])
        }
        mix[env]["all"] = mix_row(env_groups, env_mixed, every_group, every_mixed)
    return mix


def mix_row(groups: int, mixed: int, of_groups: int, of_mixed: int) -> dict[str, float]:
    """One row of cell_mix: counts, and shares of the enclosing counts."""
    return {
        "groups": groups,
        "mixed": mixed,
        "share": groups / of_groups if of_groups else 0.0,
        "mixed_share": mixed / of_mixed if of_mixed else 0.0,
        "mixed_rate": mixed / groups if groups else 0.0,
    }
