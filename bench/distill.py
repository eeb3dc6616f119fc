"""Distillation benchmark: a teacher made by RL on this box, distilled into the base model
on-policy (envs[].teacher), against the RL run that made it, by wall time.

    agentjet local (configs/local.toml: SmolLM2-135M, arithmetic) for --teacher-minutes
        ──▶ the teacher: its final checkpoint; the RL curve: its checkpoints by time
    agentjet local, same config, from the base, envs.0.teacher = the teacher, for --minutes
        ──▶ the student's checkpoints by time
    held-out arithmetic (seed 12345, greedy) of the base, the teacher, the RL run's and the
    student's checkpoints ──▶ bench/results/distill.json

Run: `just bench-distill` (or `.venv/bin/python bench/distill.py --teacher-minutes 15
--minutes 5`); `--teacher DIR` takes a teacher checkpoint instead of training one (then
the RL curve is absent).

`--arm-set KEY=VALUE` (repeatable) with `--seeds 0,1,2`: a paired comparison with the same
teacher (one RL run, or `--teacher`): per seed, the student as `--student-set` says ("base")
and again with the `--arm-set` settings too ("arm"), one after the other ──▶ per run its
curve and minutes to the teacher less 1 point, and the paired difference in held-out at the
end, mean and standard error ──▶ bench/results/distill_paired.json.

`--two-teachers`: the multi-teacher case. Two teachers made by RL on this box, one on
arithmetic and one on python_code (`--teacher-minutes` each), distilled into one student
trained on both environments (arithmetic with the first as envs.0.teacher, python_code
with the second as envs.1.teacher) for `--minutes`; held-out per environment of the base,
each teacher on its own environment and the student's checkpoints ──▶
bench/results/distill_two.json. python_code's held-out set is its 20 tasks (all it has),
greedy and 4 sampled answers each (one greedy task is 5 points). Target (issue 25): the
student within 2 points of each teacher on that teacher's environment.

The target (issue 25): the student reaches the teacher's held-out accuracy less 1 point in
at most a third of the wall time the teacher's RL took (`minutes_to_teacher_minus_1pt` <=
`teacher_minutes` / 3). `rl` is the RL run's own accuracy at the student's wall time: what
the same minutes of RL from the base gave.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from learn import HELDOUT_SEED, ROOT, train, write_result  # noqa: E402
from sched_train import (  # noqa: E402
    CODE_TASKS,
    HELDOUT_SAMPLES,
    checkpoints,
    heldout_files,
    mean_and_se,
    setup_config,
    time_to_reach,
)
from sched_train import heldout as heldout_of  # noqa: E402

from agentjet.metrics import read_metrics  # noqa: E402

# Every checkpoint kept (the curves are read off them), one every 5 versions.
SETTINGS = ("trainer.checkpoint_every=5", "trainer.keep_checkpoints=0")
# The student's, before --student-set (which may override them): two samples a task (the
# teacher term needs no group to compare against, so more tasks a step) and the teacher's
# top 16 at each token (bench/LOG.md 2026-12-05). `--student-set envs.0.teacher_top_k=0`:
# the sampled-token term alone. (--two-teachers takes --student-set only.)
STUDENT = ("rollout.group_size=2", "envs.0.teacher_top_k=16")
# Shares of the student's run at which its checkpoints are evaluated, besides the last.
EARLIER_AT = (0.2, 0.4, 0.6, 0.8)


def heldout(checkpoint: Path | str, files: dict[str, Path], config: Path) -> float:
    """Greedy held-out accuracy of a checkpoint ("base": the base model)."""
    return float(heldout_of(Path(checkpoint), files, config, 0)["overall"])


def version_minutes(run_dir: Path, started: float) -> dict[int, float]:
    """Minutes into the run at which each policy version was made."""
    rows = read_metrics(run_dir / "metrics" / "trainer.jsonl")
    return {
        r["policy_version"]: (r["time"] - started) / 60 for r in rows if r.get("event") == "step"
    }


def curve(
    run_dir: Path, started: float, wall_s: float, files: dict[str, Path], config: Path
) -> list[tuple[float, float]]:
    """(minutes, held-out accuracy) of the run's checkpoints at EARLIER_AT shares of its
    wall time and its last, oldest first."""
    saved = checkpoints(run_dir)
    if not saved:
        sys.exit(f"{run_dir}: no checkpoint (no policy version in {wall_s:.0f} s?)")
    made = version_minutes(run_dir, started)
    picked = {saved[-1]}
    for share in EARLIER_AT:
        early = [(v, p) for v, p in saved if made.get(v, 1e9) <= share * wall_s / 60]
        if early:
            picked.add(early[-1])
    points = [(round(made.get(v, wall_s / 60), 2), heldout(p, files, config)) for v, p in picked]
    return sorted(points)


def at_minutes(
    run_dir: Path, started: float, minutes: float, files: dict[str, Path], config: Path
) -> tuple[float, float]:
    """(minutes, accuracy) of the run's last checkpoint made by `minutes` into it."""
    made = version_minutes(run_dir, started)
    early = [(v, p) for v, p in checkpoints(run_dir) if made.get(v, 1e9) <= minutes]
    if not early:
        return 0.0, heldout("base", files, config)
    version, path = early[-1]
    return round(made[version], 2), heldout(path, files, config)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher-minutes", type=float, default=15.0)
    parser.add_argument("--minutes", type=float, default=5.0, help="the student's run")
    parser.add_argument("--teacher", type=Path, help="a teacher checkpoint (no RL run)")
    parser.add_argument(
        "--teacher-rl-minutes", type=float, help="with --teacher: the minutes its RL run took"
    )
    parser.add_argument("--coef", type=float, default=1.0, help="envs.0.teacher_coef")
    parser.add_argument("--heldout", type=int, default=200, help="arithmetic held-out tasks")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.toml")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "distill.json")
    parser.add_argument("--set", action="append", default=[], help="for every run")
    parser.add_argument(
        "--two-teachers", action="store_true", help="arithmetic and python_code teachers"
    )
    parser.add_argument(
        "--student-set", action="append", default=[], help="for the student's run only"
    )
    parser.add_argument(
        "--arm-set", action="append", default=[], help="paired: the arm's settings (see above)"
    )
    parser.add_argument("--seeds", default="0", help="paired: run.seed of each pair")
    args = parser.parse_args()
    root = ROOT / "runs" / f"bench-distill-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True)
    if args.two_teachers:
        return two_teachers(args, root)
    files = heldout_files(root, "arithmetic", args.heldout)
    settings = [*SETTINGS, *args.set]
    result: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "heldout_tasks": args.heldout,
        "heldout_seed": HELDOUT_SEED,
        "settings": settings,
        "teacher_coef": args.coef,
        "student_start": heldout("base", files, args.config),
    }
    print(json.dumps(result), flush=True)

    rl_dir = root / "rl"
    if args.teacher is None:  # the teacher: RL from the base
        started = time.time()
        wall_s, _ = train(
            args.teacher_minutes, args.config, rl_dir, [a for s in settings for a in ("--set", s)]
        )
        teacher = root / "teacher"  # kept: the teacher of a rerun (--teacher)
        shutil.move(checkpoints(rl_dir)[-1][1], teacher)
        result["teacher_minutes"] = round(wall_s / 60, 2)
        rl_started = started
    else:
        teacher = args.teacher
        result["teacher_minutes"] = args.teacher_rl_minutes  # what its RL run took, if known
    if result["teacher_minutes"] is not None:
        result["target_minutes"] = round(result["teacher_minutes"] / 3, 2)
    result["teacher"] = str(teacher)
    result["teacher_heldout"] = heldout(teacher, files, args.config)
    print(json.dumps(result), flush=True)
    write_result(args.out, result)

    overrides = [
        *settings,
        f"envs.0.teacher={json.dumps(str(teacher))}",
        f"envs.0.teacher_coef={args.coef}",
        *STUDENT,
        *args.student_set,
    ]
    target = result["teacher_heldout"] - 0.01
    result["student_settings"] = [*STUDENT, *args.student_set]
    if args.arm_set:
        return paired(args, root, files, overrides, target, result)
    student_dir = root / "distill"
    result["distill"] = student(args, student_dir, files, overrides, target)
    wall_s = result["distill"]["minutes"] * 60
    result["minutes_to_teacher_minus_1pt"] = result["distill"].pop("minutes_to_target")
    if args.teacher is None:
        rl_minutes, rl_accuracy = at_minutes(rl_dir, rl_started, wall_s / 60, files, args.config)
        result["rl"] = {"minutes": rl_minutes, "heldout": rl_accuracy}
    write_result(args.out, result)
    print(json.dumps(result), flush=True)
    for run in (rl_dir, student_dir):  # ~0.5 GB a checkpoint; metrics and history stay
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
    return 0


def student(
    args: argparse.Namespace,
    run_dir: Path,
    files: dict[str, Path],
    overrides: list[str],
    target: float,
) -> dict:
    """One student run of `args.minutes` with `overrides`: its curve, KL to the teacher,
    peak memory and minutes to `target` (None: not reached)."""
    started = time.time()
    wall_s, peak = train(
        args.minutes, args.config, run_dir, [a for s in overrides for a in ("--set", s)]
    )
    points = curve(run_dir, started, wall_s, files, args.config)
    batches = [
        r for r in read_metrics(run_dir / "metrics" / "rollout.jsonl") if r.get("event") == "batch"
    ]
    kls = [r["distill/kl_to_teacher"] for r in batches]
    reached = time_to_reach(points, target)
    return {
        "minutes": round(wall_s / 60, 2),
        "heldout": points[-1][1],
        "curve": points,
        "kl_to_teacher_first_last": [round(kls[0], 4), round(kls[-1], 4)] if kls else None,
        "peak_pss_mb": {k: round(v) for k, v in peak.items()},
        "minutes_to_target": None if reached is None else round(reached, 2),
    }


def paired(
    args: argparse.Namespace,
    root: Path,
    files: dict[str, Path],
    overrides: list[str],
    target: float,
    result: dict,
) -> int:
    """The paired comparison (module docstring, `--arm-set`)."""
    out = args.out if args.out.name != "distill.json" else args.out.with_name("distill_paired.json")
    result["arm_settings"] = args.arm_set
    result["runs"] = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm, extra in (("base", []), ("arm", args.arm_set)):
            run_dir = root / f"student-{arm}-{seed}"
            run = student(args, run_dir, files, [*overrides, f"run.seed={seed}", *extra], target)
            result["runs"].append({"seed": seed, "arm": arm, **run})
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            print(json.dumps(result["runs"][-1]), flush=True)
            write_result(out, result)
    by = {(r["seed"], r["arm"]): r for r in result["runs"]}
    seeds = sorted({r["seed"] for r in result["runs"]})
    diffs = [by[(s, "arm")]["heldout"] - by[(s, "base")]["heldout"] for s in seeds]
    mean, se = mean_and_se(diffs)
    result["summary"] = {
        "heldout_diff_mean": round(mean, 4),
        "heldout_diff_se": round(se, 4),
        "reached_teacher_minus_1pt": {
            arm: sum(by[(s, arm)]["minutes_to_target"] is not None for s in seeds)
            for arm in ("base", "arm")
        },
        "target_minutes": result.get("target_minutes"),  # None: teacher's RL time unknown
    }
    write_result(out, result)
    print(json.dumps(result["summary"]), flush=True)
    return 0


TWO_ENVS = ("arithmetic", "python_code")


def by_env(checkpoint: Path | str, files: dict[str, Path], config: Path) -> dict[str, dict]:
    """Per environment: greedy held-out accuracy, and for python_code (20 tasks) also the
    accuracy of HELDOUT_SAMPLES sampled answers per task."""
    out = {}
    for env, tasks in files.items():
        greedy = float(heldout_of(Path(checkpoint), {env: tasks}, config, 0)["overall"])
        out[env] = {"greedy": greedy}
        if env == "python_code":
            sampled = heldout_of(Path(checkpoint), {env: tasks}, config, HELDOUT_SAMPLES)
            out[env]["sampled"] = float(sampled["overall"])
    return out


def two_teachers(args: argparse.Namespace, root: Path) -> int:
    """The multi-teacher benchmark (module docstring, `--two-teachers`)."""
    out = args.out if args.out.name != "distill.json" else args.out.with_name("distill_two.json")
    config = setup_config(root, "cocktail", args.config)  # arithmetic, then python_code
    files = heldout_files(root, "cocktail", args.heldout)
    settings = [*SETTINGS, *args.set]
    result: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "heldout_tasks": {"arithmetic": args.heldout, "python_code": CODE_TASKS},
        "heldout_seed": HELDOUT_SEED,
        "settings": settings,
        "student_settings": args.student_set,
        "teacher_coef": args.coef,
        "student_start": by_env("base", files, config),
        "teachers": {},
    }
    print(json.dumps(result), flush=True)
    for env in TWO_ENVS:  # each teacher: RL from the base on its env
        run = root / f"rl-{env}"
        # the config's held-out set (eval_file) is arithmetic
        only = [*settings, f"envs.0.name={json.dumps(env)}", 'envs.0.eval_file=""']
        wall_s, _ = train(
            args.teacher_minutes, args.config, run, [a for s in only for a in ("--set", s)]
        )
        teacher = root / f"teacher-{env}"
        shutil.move(checkpoints(run)[-1][1], teacher)
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
        result["teachers"][env] = {
            "dir": str(teacher),
            "minutes": round(wall_s / 60, 2),
            "heldout": by_env(teacher, {env: files[env]}, config)[env],
        }
        print(json.dumps(result), flush=True)
        write_result(out, result)

    student_dir = root / "distill"
    overrides = [*settings]
    for index, env in enumerate(TWO_ENVS):
        overrides += [
            f"envs.{index}.teacher={json.dumps(result['teachers'][env]['dir'])}",
            f"envs.{index}.teacher_coef={args.coef}",
        ]
    overrides += args.student_set
    started = time.time()
    wall_s, peak = train(
        args.minutes, config, student_dir, [a for s in overrides for a in ("--set", s)]
    )
    saved = checkpoints(student_dir)
    if not saved:
        sys.exit(f"{student_dir}: no checkpoint")
    made = version_minutes(student_dir, started)
    picked = {saved[-1]}
    for share in (0.5, 0.75):
        early = [(v, p) for v, p in saved if made.get(v, 1e9) <= share * wall_s / 60]
        if early:
            picked.add(early[-1])
    curve_points = [
        (round(made.get(v, wall_s / 60), 2), by_env(p, files, config)) for v, p in sorted(picked)
    ]
    final = curve_points[-1][1]
    batches = [
        r
        for r in read_metrics(student_dir / "metrics" / "rollout.jsonl")
        if r.get("event") == "batch"
    ]
    kls = {
        env: [
            r["distill/kl_to_teacher"]
            for r in batches
            if r.get("env") == env and "distill/kl_to_teacher" in r
        ]
        for env in TWO_ENVS
    }
    result["student"] = {
        "minutes": round(wall_s / 60, 2),
        "heldout": final,
        "curve": curve_points,
        "peak_pss_mb": {k: round(v) for k, v in peak.items()},
    }
    result["gap_to_teacher_points"] = {
        env: {
            kind: round(100 * (result["teachers"][env]["heldout"][kind] - final[env][kind]), 1)
            for kind in result["teachers"][env]["heldout"]
        }
        for env in TWO_ENVS
    }
    result["kl_first_last"] = {e: [round(k[0], 4), round(k[-1], 4)] for e, k in kls.items() if k}
    write_result(out, result)
    shutil.rmtree(student_dir / "checkpoints", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
