"""Scheduling benchmark: EnvSched vs uniform on real training of SmolLM2-135M.

    held-out tasks (seed 12345) ── for scheduler in (uniform, envsched), same seeds:
        agentjet local --config configs/local.toml --set coordinator.scheduler=S  (--minutes)
        ──▶ zero-variance fraction of trained groups, effective (non-zero-advantage)
            samples per second, held-out accuracy of the final checkpoint: greedy, and
            sampled as rollouts sample (HELDOUT_SAMPLES answers per task, temperature 1)
    ──▶ bench/results/sched.json

Run: `just bench-sched` (or `.venv/bin/python bench/sched_train.py --minutes 8 --seeds 0,1,2`).
Both arms train on the same mixed arithmetic set (all three difficulties, all three ops),
with the same update size: a policy version is `trainer.informative_samples_per_step`
samples that carry gradient (SHARED_SETTINGS), not a number of groups. With a fixed number
of groups per version, a scheduler that makes more groups informative makes every step
longer and the run gets fewer versions for the same wall time (bench/LOG.md, first run).

One run of each arm is not enough to compare held-out accuracy: identical configurations
differ by about 3 points from run to run (bench/LOG.md, third run). So each seed
(`run.seed`: sampling, task draws, initial order) trains both arms, one after the other,
seed by seed, so slow phases of the machine fall on both; the result gives every seed's
figures, the mean of each arm and the paired difference with its standard error.

Held-out accuracy is measured two ways, greedy and sampled at the rollouts' temperature:
training raises the sampled figure (the RL objective), and the greedy one shows only what
moves the argmax. On this model they differ most on 1-digit problems, which greedy
decoding already solves (bench/LOG.md).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from learn import (  # noqa: E402
    HELDOUT_SEED,
    ROOT,
    evaluate,
    final_checkpoint,
    make_heldout,
    train,
    write_result,
)

from agentjet.metrics import read_metrics  # noqa: E402
from coordinator.envsched import group_sums  # noqa: E402
from coordinator.store import Store  # noqa: E402

SCHEDULERS = ("uniform", "envsched")
# Both arms: train every 4 groups, step the optimizer every 24 samples with gradient
# (what 8 uniform groups hold on average at the start of training).
SHARED_SETTINGS = ("trainer.groups_per_step=4", "trainer.informative_samples_per_step=24")
# Answers sampled per held-out task for the sampled accuracy (400 tasks: about 2 minutes).
HELDOUT_SAMPLES = 4
# The held-out figures, each aggregated with its standard error and paired across arms.
HELDOUT_FIGURES = ("heldout_accuracy", "heldout_sampled_accuracy")


def granted_work(run_dir: Path) -> dict:
    """Where the scheduler sent the rollouts (the coordinator's history): per difficulty,
    the groups reported and the fraction of them that were mixed, overall, for a task's
    first group, and for a group of a task whose previous group was mixed (what the
    frontier re-offers); distinct tasks overall."""
    store = Store(run_dir / "coordinator.sqlite", lease_s=1.0)
    try:
        reports = list(store.accepted_reports())
    finally:
        store.close()
    last_mixed: dict[str, bool] = {}
    groups: defaultdict[tuple[str, str], list[bool]] = defaultdict(list)
    for task, report in reports:
        mixed = group_sums(report).mixed > 0
        difficulty = str(task.difficulty)
        groups[difficulty, "all"].append(mixed)
        if task.id not in last_mixed:
            groups[difficulty, "first_visit"].append(mixed)
        elif last_mixed[task.id]:
            groups[difficulty, "after_mixed"].append(mixed)
        last_mixed[task.id] = mixed
    by_difficulty: dict[str, dict[str, float]] = {}
    for difficulty in sorted({d for d, _ in groups}):
        row = by_difficulty[difficulty] = {}
        for kind, name in (
            ("all", ""),
            ("first_visit", "first_visit_"),
            ("after_mixed", "after_mixed_"),
        ):
            mixed = groups.get((difficulty, kind), [])
            row[f"{name}groups"] = len(mixed)
            row[f"{name}mixed_frac"] = round(sum(mixed) / len(mixed), 4) if mixed else None
    return {
        "groups_by_difficulty": by_difficulty,
        "distinct_tasks": len(last_mixed),
    }


def summarize(run_dir: Path, wall_s: float, greedy: dict, sampled: dict) -> dict:
    steps = [
        r for r in read_metrics(run_dir / "metrics" / "trainer.jsonl") if r.get("event") == "step"
    ]
    groups = sum(len(r["trained_group_ids"]) for r in steps)
    zero = sum(r["charts/zero_variance_groups"] for r in steps)
    effective = sum(r["charts/trained_samples"] for r in steps)
    return {
        "zero_variance_frac": round(zero / max(groups, 1), 4),
        "effective_samples_per_s": round(effective / wall_s, 4),
        "heldout_accuracy": greedy["overall"],
        "heldout_by_difficulty": greedy["by_difficulty"],
        "heldout_sampled_accuracy": sampled["overall"],
        "heldout_sampled_by_difficulty": sampled["by_difficulty"],
        "policy_versions": len({r["policy_version"] for r in steps}),
        "groups_trained": groups,
        "wall_s": round(wall_s, 1),
        **granted_work(run_dir),
    }


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (0 for a single value)."""
    if len(values) < 2:
        return statistics.fmean(values), 0.0
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def aggregate(runs: list[dict]) -> dict:
    """An arm over its seeds: the mean of every figure, and each seed's figures."""
    keys = ("zero_variance_frac", "effective_samples_per_s")
    summary: dict = {k: round(statistics.fmean(r[k] for r in runs), 4) for k in keys}
    for figure in HELDOUT_FIGURES:
        mean, se = mean_and_se([r[figure] for r in runs])
        summary |= {figure: round(mean, 4), f"{figure}_se": round(se, 4)}
    summary["per_seed"] = runs
    return summary


def load_earlier(path: Path, args: argparse.Namespace, seeds: list[int]) -> dict:
    """An earlier result made with the same settings (its seeds join this run's)."""
    earlier = json.loads(path.read_text())
    same = {
        "minutes": args.minutes,
        "heldout_tasks": args.heldout,
        "heldout_samples": HELDOUT_SAMPLES,
        "settings": args.set,
    }
    for key, value in same.items():
        if earlier.get(key) != value:
            sys.exit(f"{path}: {key} is {earlier.get(key)!r}, this run's is {value!r}")
    overlap = set(seeds) & set(earlier["seeds"])
    if overlap:
        sys.exit(f"{path} already holds seeds {sorted(overlap)}")
    return earlier


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="per arm and seed")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run.seed values")
    parser.add_argument(
        "--arms", default=",".join(SCHEDULERS), help="schedulers to run (default: both)"
    )
    parser.add_argument("--heldout", type=int, default=400)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.toml")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sched.json")
    parser.add_argument(
        "--set", action="append", default=list(SHARED_SETTINGS), help="for both arms"
    )
    parser.add_argument(
        "--add-to",
        type=Path,
        help="an earlier result of the same settings: its seeds join this run's in the means",
    )
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    arms = [arm for arm in SCHEDULERS if arm in args.arms.split(",")]
    earlier = load_earlier(args.add_to, args, seeds) if args.add_to else {}

    root = ROOT / "runs" / f"bench-sched-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True)
    tasks = make_heldout(root, args.heldout)
    shared = [arg for setting in args.set for arg in ("--set", setting)]
    runs: dict[str, list[dict]] = {scheduler: [] for scheduler in arms}
    for seed in seeds:
        for scheduler in arms:
            run_dir = root / f"{scheduler}-seed{seed}"
            overrides = [
                "--set",
                f'coordinator.scheduler="{scheduler}"',
                "--set",
                f"run.seed={seed}",
            ]
            wall_s, _ = train(args.minutes, args.config, run_dir, [*shared, *overrides])
            checkpoint = str(final_checkpoint(run_dir))
            greedy = evaluate(checkpoint, tasks, args.config)
            sampled = evaluate(checkpoint, tasks, args.config, HELDOUT_SAMPLES)
            shutil.rmtree(run_dir / "checkpoints")  # ~3 GB a run; metrics and history stay
            summary = summarize(run_dir, wall_s, greedy, sampled)
            runs[scheduler].append({"seed": seed, **summary})
            print(scheduler, json.dumps(runs[scheduler][-1]), flush=True)

    for scheduler in arms:  # earlier seeds first, in their order
        runs[scheduler] = earlier.get(scheduler, {}).get("per_seed", []) + runs[scheduler]
    result: dict = {
        "minutes": args.minutes,
        "seeds": [r["seed"] for r in runs[arms[0]]],
        "heldout_tasks": args.heldout,
        "heldout_samples": HELDOUT_SAMPLES,
        "heldout_seed": HELDOUT_SEED,
        "settings": args.set,
        **{scheduler: aggregate(runs[scheduler]) for scheduler in arms},
        "date": time.strftime("%Y-%m-%d"),
    }
    if args.add_to:
        result["note"] = f"seeds {earlier['seeds']} are from an earlier run ({earlier['date']})"
        if "note" in earlier:
            result["note"] += f"; of that run: {earlier['note']}"
    if len(arms) == 2:  # EnvSched minus uniform, paired by seed
        for figure in HELDOUT_FIGURES:
            uniform = {r["seed"]: r[figure] for r in runs["uniform"]}
            gap, gap_se = mean_and_se([r[figure] - uniform[r["seed"]] for r in runs["envsched"]])
            result[f"{figure}_gap"] = {"mean": round(gap, 4), "se": round(gap_se, 4)}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
