"""Scheduling benchmark: EnvSched against uniform sampling, both with dynamic sampling, in
the regime a scheduler is for (generation-bound), on real training of SmolLM2-135M.

    for set-up in (arithmetic, cocktail = arithmetic + python_code):
      for seed in seeds:           (paired: both arms of a seed run back to back)
        for arm in (uniform, envsched):
          agentjet local --config <set-up> --set coordinator.scheduler=ARM
                         --set trainer.dynamic_sampling=true     (--minutes of wall time)
          ──▶ generated samples, trained groups, zero-variance share, busy fractions,
              trained groups per difficulty (the cell mix), held-out accuracy of the final
              checkpoint per environment, greedy and sampled; for EnvSched also of earlier
              checkpoints, for the wall time it takes to reach uniform's final accuracy
    ──▶ bench/results/sched.json

Run: `just bench-sched` (or `.venv/bin/python bench/sched_train.py --minutes 5 --seeds 0,1,2`).

Dynamic sampling (trainer.dynamic_sampling) makes every step train `groups_per_step` groups
whose rewards vary, so both arms take steps of the same effective batch and a scheduler can
only save generation: it is judged by the samples it generates per trained group and by
what the policy learns in the same wall time. The trainer waits for varied groups while the
rollout node generates, so the runs are generation-bound by construction; the result shows
it with each role's busy fraction (the rollout node's time generating, the trainer's time in
train steps, over the wall time).

Held-out accuracy: arithmetic on tasks generated with a seed training never uses; python_code
has only about 20 distinct tasks, so its "held-out" set is all of them (the figure says what
the policy can do on the environment, not how it generalises). `overall` is the mean over the
set-up's environments. Identical configurations differ by about 3 points from run to run
(bench/LOG.md), hence several seeds and paired differences with their standard errors.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from learn import AGENTJET, HELDOUT_SEED, ROOT, evaluate, train, write_result  # noqa: E402

from agentjet.metrics import read_metrics  # noqa: E402
from agentjet.rl import zero_variance  # noqa: E402
from coordinator.envsched_status import cell_mix  # noqa: E402
from coordinator.store import Store  # noqa: E402

ARMS = ("uniform", "envsched")
# Extra [[envs]] entries of each set-up, after configs/local.toml's arithmetic.
SETUPS = {
    "arithmetic": "",
    "cocktail": '\n[[envs]]\nname = "python_code"\ndifficulties = [1, 2, 3]\n',
}
# Both arms, every set-up: steps of varied groups only; every checkpoint kept (the time to
# reach uniform's final accuracy is read off EnvSched's earlier ones).
SHARED_SETTINGS = (
    "trainer.dynamic_sampling=true",
    # 4 varied groups a version: about 11 generated groups under uniform sampling
    "trainer.groups_per_step=4",
    "trainer.checkpoint_every=5",
    "trainer.keep_checkpoints=0",
)
# Answers sampled per held-out task for the sampled accuracy.
HELDOUT_SAMPLES = 4
# python_code has this many distinct tasks or a few more: all of them are its held-out set.
CODE_TASKS = 20
# Shares of the run at which EnvSched's checkpoints are evaluated (greedy) besides the last.
EARLIER_AT = (0.6, 0.8)


def setup_config(root: Path, setup: str, base: Path) -> Path:
    path = root / f"{setup}.toml"
    path.write_text(base.read_text() + SETUPS[setup])
    return path


def heldout_files(root: Path, setup: str, count: int) -> dict[str, Path]:
    """Per environment of the set-up, its held-out task file."""
    files = {"arithmetic": root / "heldout-arithmetic.jsonl"}
    if setup == "cocktail":
        files["python_code"] = root / "heldout-python_code.jsonl"
    for env, path in files.items():
        if not path.exists():
            n = count if env == "arithmetic" else CODE_TASKS
            subprocess.run(
                [*AGENTJET, "tasks", "--env", env, "--count", str(n),
                 "--seed", str(HELDOUT_SEED), "--out", str(path)],
                check=True, cwd=ROOT,
            )  # fmt: skip
    return files


def heldout(checkpoint: Path, files: dict[str, Path], config: Path, samples: int) -> dict:
    """Accuracy per environment and their mean (greedy when `samples` is 0)."""
    by_env = {}
    for env, tasks in files.items():
        result = evaluate(str(checkpoint), tasks, config, samples, env=env)
        by_env[env] = {k: result[k] for k in ("overall", "by_difficulty", "n")}
    overall = statistics.fmean(r["overall"] for r in by_env.values())
    return {"overall": round(overall, 4), "by_env": by_env}


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(policy version, folder) of every checkpoint, oldest first."""
    found = []
    for meta in (run_dir / "checkpoints").glob("*/agentjet.json"):
        found.append((int(json.loads(meta.read_text())["policy_version"]), meta.parent))
    return sorted(found)


def measure(run_dir: Path, wall_s: float, started: float) -> dict:
    """A run's figures from its metrics files and the coordinator's history."""
    trainer = read_metrics(run_dir / "metrics" / "trainer.jsonl")
    rollout = read_metrics(run_dir / "metrics" / "rollout.jsonl")
    steps = [r for r in trainer if r.get("event") == "step"]
    trained = {g for r in steps for g in r["trained_group_ids"]}
    store = Store(run_dir / "coordinator.sqlite", lease_s=1.0)
    try:
        reports = [(t, r) for t, r in store.accepted_reports() if not r.failed and r.rewards]
    finally:
        store.close()
    generated = sum(len(r.rewards) for _, r in reports)
    zero = sum(1 for _, r in reports if zero_variance(r.rewards))
    gen_s = sum(r["perf/batch_s"] for r in rollout if r.get("event") == "batch")
    train_s = sum(r["perf/step_s"] for r in steps)
    version_time = {r["policy_version"]: r["time"] - started for r in steps}
    return {
        "minutes": round(wall_s / 60, 2),
        "policy_versions": len({r["policy_version"] for r in steps if r["optimizer_stepped"]}),
        "generated_samples": generated,
        "generated_groups": len(reports),
        "trained_groups": len(trained),
        "samples_per_trained_group": round(generated / max(len(trained), 1), 2),
        "zero_variance_frac": round(zero / max(len(reports), 1), 4),
        "short_steps": sum(1 for r in steps if r.get("short_step")),
        "busy": {"rollout": round(gen_s / wall_s, 3), "trainer": round(train_s / wall_s, 3)},
        # the cell mix: groups per environment and difficulty, trained and generated
        "trained_by_difficulty": groups_by_difficulty(
            cell_mix((t, r) for t, r in reports if r.grant_id in trained)
        ),
        "generated_by_difficulty": groups_by_difficulty(cell_mix(reports)),
        "version_time_s": version_time,
    }


def groups_by_difficulty(mix: dict) -> dict:
    """`cell_mix` as {env: {difficulty or "all": groups}}."""
    return {env: {d: row["groups"] for d, row in levels.items()} for env, levels in mix.items()}


def time_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """The wall time at which a (time, accuracy) curve first reaches `target`, linear
    between evaluated points; None when it never does."""
    previous = (0.0, -math.inf)
    for t, accuracy in curve:
        if accuracy >= target:
            t0, a0 = previous
            if a0 == -math.inf or accuracy == a0:
                return t
            return t0 + (t - t0) * (target - a0) / (accuracy - a0)
        previous = (t, accuracy)
    return None


def mean_and_se(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return statistics.fmean(values), 0.0
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def samples_per_trained_group(runs: list[dict]) -> float:
    """Generated samples over trained groups, pooled over `runs`."""
    samples = sum(r["generated_samples"] for r in runs)
    return samples / max(sum(r["trained_groups"] for r in runs), 1)


def summarize(runs: list[dict]) -> dict:
    """Per set-up: EnvSched against uniform, paired by seed."""
    out: dict = {}
    for setup in SETUPS:
        pairs = []
        for seed in sorted({r["seed"] for r in runs if r["setup"] == setup}):
            arm = {r["arm"]: r for r in runs if r["setup"] == setup and r["seed"] == seed}
            if set(arm) == set(ARMS):
                pairs.append((arm["uniform"], arm["envsched"]))
        if not pairs:
            continue
        uniform = samples_per_trained_group([u for u, _ in pairs])
        envsched = samples_per_trained_group([e for _, e in pairs])
        summary: dict = {
            "seeds": [u["seed"] for u, _ in pairs],
            "samples_per_trained_group": {
                "uniform": round(uniform, 2),
                "envsched": round(envsched, 2),
            },
            "samples_per_trained_group_ratio": round(envsched / uniform, 3),
        }
        for mode in ("greedy", "sampled"):
            diffs = [
                100 * (e["heldout"][mode]["overall"] - u["heldout"][mode]["overall"])
                for u, e in pairs
            ]
            mean, se = mean_and_se(diffs)
            key = "" if mode == "greedy" else "_sampled"
            summary[f"heldout_diff_mean{key}"] = round(mean, 2)
            summary[f"heldout_diff_se{key}"] = round(se, 2)
        ratios = []
        for u, e in pairs:
            reached = time_to_reach(e["curve"], u["heldout"]["greedy"]["overall"])
            ratios.append(None if reached is None else reached / u["final_time_s"])
        got = [r for r in ratios if r is not None]
        summary["time_to_uniform_final_ratio"] = round(statistics.fmean(got), 3) if got else None
        summary["time_to_uniform_final_per_seed"] = [
            None if r is None else round(r, 3) for r in ratios
        ]
        summary["reached_uniform_final"] = f"{len(got)} of {len(ratios)} seeds"
        out[setup] = summary
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="per arm and seed")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run.seed values")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--heldout", type=int, default=200, help="arithmetic held-out tasks")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.toml")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sched.json")
    parser.add_argument("--set", action="append", default=[], help="for both arms")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    setups = [s for s in SETUPS if s in args.setups.split(",")]
    settings = [*SHARED_SETTINGS, *args.set]

    root = ROOT / "runs" / f"bench-sched-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True)
    runs: list[dict] = []
    result: dict = {
        "minutes": args.minutes,
        "heldout_tasks": {"arithmetic": args.heldout, "python_code": CODE_TASKS},
        "heldout_samples": HELDOUT_SAMPLES,
        "heldout_seed": HELDOUT_SEED,
        "settings": settings,
        "runs": runs,
    }
    for setup in setups:
        config = setup_config(root, setup, args.config)
        files = heldout_files(root, setup, args.heldout)
        for seed in seeds:
            for arm in ARMS:
                run_dir = root / f"{setup}-{arm}-seed{seed}"
                overrides = [f'coordinator.scheduler="{arm}"', f"run.seed={seed}", *settings]
                started = time.time()
                wall_s, _ = train(
                    args.minutes, config, run_dir, [a for s in overrides for a in ("--set", s)]
                )
                figures = measure(run_dir, wall_s, started)
                saved = checkpoints(run_dir)
                if not saved:
                    sys.exit(f"{run_dir}: no checkpoint (no policy version in {wall_s:.0f} s?)")
                final = saved[-1][1]
                run = {
                    # when the final checkpoint's version was stepped (the time to compare)
                    "final_time_s": round(figures["version_time_s"].get(saved[-1][0], wall_s), 1),
                    "setup": setup,
                    "seed": seed,
                    "arm": arm,
                    **figures,
                    "heldout": {
                        "greedy": heldout(final, files, config, 0),
                        "sampled": heldout(final, files, config, HELDOUT_SAMPLES),
                    },
                }
                if arm == "envsched":  # earlier checkpoints: when it reached what
                    times = figures["version_time_s"]
                    curve = []
                    for share in EARLIER_AT:
                        early = [
                            (v, p) for v, p in saved if times.get(v, math.inf) <= share * wall_s
                        ]
                        if early:
                            version, path = early[-1]
                            accuracy = heldout(path, files, config, 0)["overall"]
                            curve.append((round(times[version], 1), accuracy))
                    curve.append((run["final_time_s"], run["heldout"]["greedy"]["overall"]))
                    run["curve"] = sorted(set(curve))
                del run["version_time_s"]
                shutil.rmtree(run_dir / "checkpoints")  # ~0.5 GB each; metrics and history stay
                runs.append(run)
                print(json.dumps({k: run[k] for k in ("setup", "seed", "arm", "heldout")}),
                      flush=True)  # fmt: skip
                result["summary"] = summarize(runs)
                result["date"] = time.strftime("%Y-%m-%d")
                write_result(args.out, result)  # after every run: a stopped bench keeps its runs
    return 0


if __name__ == "__main__":
    sys.exit(main())
