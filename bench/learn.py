"""Learning benchmark: does `agentjet local` make SmolLM2-135M better at arithmetic?

    held-out tasks (seed 12345, never the training seed) ──eval base──▶ before
    per seed (--seeds; run.seed 0, 1, 2): agentjet local --config configs/local.toml for
    --minutes of wall time (then Ctrl-C), a checkpoint every --checkpoint-every versions
    ──eval at each --marks minute the newest checkpoint saved by then, and the final one──▶
    "curve" [{seed, mark, minutes, version, overall}] ──▶ bench/results/learn.json
    (with each seed's speed, effective samples/s, zero-variance share and peak memory)

The curve's minutes count from the launch of `agentjet local` (model loading included),
and a mark's point is the checkpoint saved at or before it: at the default resolution (5
versions, 50-80 s on a 2-core box) a point may be up to that much older than its mark,
never younger. A checkpoint every 5 versions costs the runs a few percent of their time.

Run: `just bench-learn` (or `.venv/bin/python bench/learn.py --minutes 15`). Seeds run
one at a time (`--seeds 1 --first-seed N`) make one result with `--merge FILE... --out F`.
`--task parity` trains on your-own-data terms instead: a Parquet dataset of numbers to
classify as "even" or "odd" (word answers), scored by a user reward function
(bench/parity.py), through the "prompt" environment; results in
bench/results/learn_custom.json.
`--task reasoning_gym --dataset NAME` trains configs/reasoning_gym.toml's entry for that
reasoning-gym dataset alone (`--config` another config with such entries) and scores it on
the environment's own held-out rows (--heldout of them, rows training never draws; the
same rows before and after); results in bench/results/learn_rg_<NAME>.json.
`--memory-only` skips both evaluations: it trains for --minutes and writes the peak PSS
per role with the run's speed (bench/results/learn_memory.json by default), for A/B runs
of a memory change that need no learning figures.
The reference point (TRL GRPOTrainer, same model, lr 1e-5, 8 prompts x 8 samples, 32 new
tokens, 15 minutes on this 2-core box): 29% -> 44% overall, 1-digit 74% -> 96%,
2-digit 11% -> 32%, peak RSS 6.7 GB (one process).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentjet.lifeline import descendants, process_table  # noqa: E402
from agentjet.metrics import read_metrics  # noqa: E402
from node.weights import read_checkpoint_meta  # noqa: E402

HELDOUT_SEED = 12345
AGENTJET = [sys.executable, "-m", "agentjet_app.cli"]


def memory_mb(pids: set[int]) -> float:
    """Proportional set size of `pids` together: pages shared between processes (hivemind
    forks its averagers from the trainer) count once, unlike a sum of RSS."""
    total_kb = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
    return total_kb / 1024


ROLES = ("trainer", "rollout", "coordinator", "other")


def role_of(pid: int) -> str:
    """The role `agentjet local` started as `pid` (from its argv), else "other"."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"
    if b"coordinator" in argv:
        return "coordinator"
    for role in ("trainer", "rollout"):
        if role.encode() in argv and b"--role" in argv:
            return role
    return "other"


def memory_by_role(launcher: int) -> dict[str, float]:
    """PSS (MB) of each role's process tree under the `agentjet local` launcher (a role's
    children, hivemind's averagers and DHT, p2pd, sandboxes, count as the role's); the
    launcher, the dashboard and anything else are "other"."""
    table = process_table()
    by_role = dict.fromkeys(ROLES, 0.0)
    by_role["other"] = memory_mb({launcher})
    for child, info in table.items():
        if info.ppid == launcher:
            by_role[role_of(child)] += memory_mb({child} | descendants(child, table))
    return by_role


def final_checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()


def write_result(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def make_heldout(run_dir: Path, count: int) -> Path:
    """The held-out task file: generated with a seed that training never uses."""
    tasks = run_dir / "heldout.jsonl"
    subprocess.run(
        [*AGENTJET, "tasks", "--count", str(count), "--seed", str(HELDOUT_SEED),
         "--out", str(tasks)],
        check=True, cwd=ROOT,
    )  # fmt: skip
    return tasks


def make_parity_task(run_dir: Path, held_out: int) -> tuple[Path, list[str]]:
    """bench/parity.py's dataset: training rows as Parquet, held-out rows as JSONL; the
    config overrides that train a "prompt" environment on them with its reward."""
    import pyarrow
    import pyarrow.parquet

    from bench.parity import split

    train_rows, held_out_rows = split(held_out)
    train_file = run_dir / "parity_train.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(train_rows), train_file)
    held_out_file = run_dir / "parity_heldout.jsonl"
    held_out_file.write_text("".join(json.dumps(r) + "\n" for r in held_out_rows))
    overrides = [
        'envs.0.name="prompt"',
        f"envs.0.task_file={json.dumps(str(train_file))}",
        'envs.0.reward="bench.parity:first_class"',
        'envs.0.eval_file=""',  # the config's held-out set is arithmetic
    ]
    return held_out_file, overrides


def one_dataset(config: Path, dataset: str, held_out: int) -> list[str]:
    """Overrides that train `config`'s first reasoning_gym entry on its `dataset` entry
    alone, with `held_out` held-out rows."""
    import tomllib

    envs = tomllib.loads(config.read_text())["envs"]
    i, env = next((i, e) for i, e in enumerate(envs) if e["name"] == "reasoning_gym")
    entries = [t for t in env["tasks"] if t["name"] == dataset]
    if not entries:
        names = [t["name"] for t in env["tasks"]]
        raise SystemExit(f"--dataset {dataset!r}: {config} trains {names}")
    return [f"envs.{i}.tasks={inline_toml(entries)}", f"envs.{i}.eval_rows={held_out}"]


def inline_toml(value: object) -> str:
    """`value` (tables, arrays, strings, numbers, booleans) as a TOML inline value."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {inline_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(inline_toml(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)  # a JSON string or number is a TOML one


def evaluate(
    checkpoint: str,
    tasks: Path | None,
    config: Path,
    samples: int = 0,
    env: str = "arithmetic",
    overrides: list[str] | None = None,
) -> dict:
    """`agentjet eval`: greedy, or `samples` sampled answers per task (no task file: the
    environment's own held-out tasks)."""
    task_file = [] if tasks is None else ["--tasks", str(tasks)]
    # Scoring runs alone on the box: every core (training's rollout node has one); and in
    # float32 whatever dtype training computed in, so every run is scored alike.
    overrides = [
        *(overrides or []),
        f"rollout.torch_threads={os.cpu_count() or 1}",
        'model.dtype="float32"',
    ]
    out = subprocess.run(
        [*AGENTJET, "eval", "--checkpoint", checkpoint, *task_file,
         "--config", str(config), "--samples", str(samples), "--env", env,
         *(a for s in overrides for a in ("--set", s))],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    return json.loads(out.stdout)


def train(
    minutes: float, config: Path, run_dir: Path, extra: list[str]
) -> tuple[float, dict[str, float], float]:
    """Run `agentjet local` for `minutes`, then stop it like a user would (SIGINT); the
    wall time, the peak PSS (MB) of all roles together ("total") and of each role, and the
    seconds from that SIGINT to its exit (0 when it ended by itself)."""
    proc = subprocess.Popen(
        [*AGENTJET, "local", "--config", str(config), "--run-dir", str(run_dir), *extra],
        cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    start = time.monotonic()
    peak = dict.fromkeys(("total", *ROLES), 0.0)
    while proc.poll() is None and time.monotonic() - start < minutes * 60:
        now = memory_by_role(proc.pid)
        now["total"] = sum(now.values())
        peak = {key: max(peak[key], now[key]) for key in peak}
        time.sleep(2.0)
    stop_s = 0.0
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        proc.wait(timeout=300)
        stop_s = time.monotonic() - interrupted
    return time.monotonic() - start, peak, stop_s


def parse_args() -> argparse.Namespace:
    """The options, with --out, --config and --seeds defaulted by --task."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--heldout", type=int, default=300, help="held-out tasks")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.toml")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "learn.json")
    parser.add_argument("--set", action="append", default=[], help="config override")
    parser.add_argument(
        "--score-set", action="append", default=[],
        help="config override for scoring only, after --set: e.g. an arm that trains with"
        " shorter answers scored at the default rollout.sampling.max_new_tokens",
    )  # fmt: skip
    parser.add_argument(
        "--task", choices=["arithmetic", "parity", "reasoning_gym"], default="arithmetic"
    )
    parser.add_argument("--dataset", default="", help="--task reasoning_gym: which entry")
    parser.add_argument("--memory-only", action="store_true", help="no evaluation")
    parser.add_argument("--seeds", type=int, default=None, help="runs (arithmetic: 3, else 1)")
    parser.add_argument("--first-seed", type=int, default=0, help="run.seed of the first run")
    parser.add_argument(
        "--marks", type=lambda v: [float(m) for m in v.split(",")], default=[2.5, 5.0, 10.0],
        help="minutes at which the curve scores the newest checkpoint (the end always)",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint-every", type=int, default=5,
        help="the runs' trainer.checkpoint_every: the curve's resolution in versions",
    )  # fmt: skip
    parser.add_argument(
        "--merge", type=Path, nargs="+", default=[],
        help="write one result (--out) of these results of one command with other seeds",
    )  # fmt: skip
    args = parser.parse_args()
    if args.memory_only and args.out == parser.get_default("out"):
        args.out = ROOT / "bench" / "results" / "learn_memory.json"
    if args.task == "parity" and args.out == parser.get_default("out"):
        args.out = ROOT / "bench" / "results" / "learn_custom.json"
    if args.task == "reasoning_gym":
        if args.config == parser.get_default("config"):
            args.config = ROOT / "configs" / "reasoning_gym.toml"
        if args.out == parser.get_default("out"):
            args.out = ROOT / "bench" / "results" / f"learn_rg_{args.dataset}.json"
    if args.seeds is None:
        args.seeds = 3 if args.task == "arithmetic" else 1
    return args


def main() -> int:
    args = parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    run_dir = ROOT / "runs" / f"bench-learn-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True)
    env = "arithmetic"
    tasks: Path | None = None
    if args.task == "parity":
        tasks, overrides = make_parity_task(run_dir, args.heldout)
        args.set = overrides + args.set
        env = "prompt"
    if args.memory_only:
        return memory_only(args, run_dir)
    if args.task == "arithmetic":
        tasks = make_heldout(run_dir, args.heldout)
    elif args.task == "reasoning_gym":
        tasks, env = None, "reasoning_gym"
        args.set = [*one_dataset(args.config, args.dataset, args.heldout), *args.set]
    marks = [m for m in args.marks if m < args.minutes]
    scoring = [*args.set, *args.score_set]
    before = evaluate("base", tasks, args.config, env=env, overrides=scoring)
    print("before:", json.dumps(before), flush=True)

    kept = ("overall", "mean_reward", "by_difficulty", "by_op", "n")
    seeds, curve = [], []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        train_dir = run_dir / f"train-seed{seed}"
        one = train_seed(args, seed, train_dir, marks)
        for point in one.pop("points"):
            scored = evaluate(point["checkpoint"], tasks, args.config, env=env, overrides=scoring)
            curve.append({"seed": seed, "mark": point["mark"], "minutes": point["minutes"],
                          "version": point["version"], "overall": scored["overall"]})  # fmt: skip
            print("curve:", json.dumps(curve[-1]), flush=True)
        after = evaluate(str(final_checkpoint(train_dir)), tasks, args.config, env=env,
                         overrides=scoring)  # fmt: skip
        print(f"after (seed {seed}):", json.dumps(after), flush=True)
        curve.append({"seed": seed, "mark": args.minutes, "minutes": one["minutes"],
                      "version": one["policy_versions"], "overall": after["overall"]})  # fmt: skip
        seeds.append({"seed": seed, "after": {k: after[k] for k in kept}, **one})
        drop_checkpoints(train_dir)

    facts = {"task": args.task, "before": {k: before[k] for k in kept}, "minutes": args.minutes}
    write_result(args.out, summary(facts | run_facts(args), seeds, curve, marks))
    return 0


def summary(facts: dict, seeds: list[dict], curve: list[dict], marks: list[float]) -> dict:
    """A result: the run's `facts`, its seeds' results and curve, and their means."""
    return {
        **facts,
        # The mean over seeds of the final held-out accuracy, and at each mark: the newest
        # checkpoint saved by then (its own minutes since launch are in "curve"), the end's
        # being the final checkpoint.
        "after_mean": mean(s["after"]["overall"] for s in seeds),
        "at_marks_mean": at_marks(curve, [*marks, facts["minutes"]], len(seeds)),
        "curve": curve,
        "seeds": seeds,
        "zero_variance_group_frac": mean(s["zero_variance_group_frac"] for s in seeds),
        "effective_samples_per_s": mean(s["effective_samples_per_s"] for s in seeds),
        "samples_per_s": mean(s["samples_per_s"] for s in seeds),
        "peak_pss_mb_max": max(s["peak_pss_mb"]["total"] for s in seeds),
        "heldout_seed": HELDOUT_SEED,
    }


def merge(paths: list[Path], out: Path) -> int:
    """One result of several runs of the same command with different seeds (a box that
    runs them between other work), written to `out`; they must agree on everything but
    their seeds and dates."""
    results = [json.loads(path.read_text()) for path in paths]
    same = ("task", "before", "minutes", "config", "overrides", "heldout_seed", "machine")
    for path, result in zip(paths[1:], results[1:], strict=True):
        differ = [key for key in same if result.get(key) != results[0].get(key)]
        if differ:
            sys.exit(f"bench/learn.py --merge: {path} differs from {paths[0]} in {differ}")
    seeds = [s for r in results for s in r["seeds"]]
    if len({s["seed"] for s in seeds}) < len(seeds):
        sys.exit("bench/learn.py --merge: a seed is in more than one file")
    curve = [point for r in results for point in r["curve"]]
    marks = sorted({p["mark"] for p in curve} - {results[0]["minutes"]})
    facts = {key: results[0][key] for key in same} | {"date": results[-1]["date"]}
    merged = summary(facts | {"merged_from": [p.name for p in paths]}, seeds, curve, marks)
    write_result(out, merged)
    return 0


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return round(sum(values) / len(values), 4) if values else 0.0


def at_marks(curve: list[dict], marks: list[float], seeds: int) -> dict[str, float | None]:
    """Per mark, the mean over seeds of the curve point at it (None when a seed has no
    checkpoint saved by then)."""
    out: dict[str, float | None] = {}
    for mark in marks:
        points = [p for p in curve if p.get("mark") == mark]
        out[f"{mark:g}"] = mean(p["overall"] for p in points) if len(points) == seeds else None
    return out


def train_seed(args: argparse.Namespace, seed: int, train_dir: Path, marks: list[float]) -> dict:
    """One training run of `args.minutes` with run.seed = `seed`, every checkpoint kept (the
    curve's); its speed and memory figures, and per mark the newest checkpoint saved by
    then ("points"), with the minutes since launch it was saved at."""
    extra = [a for s in args.set for a in ("--set", s)]
    extra += ["--set", f"run.seed={seed}", "--set", "trainer.keep_checkpoints=0",
              "--set", f"trainer.checkpoint_every={args.checkpoint_every}"]  # fmt: skip
    launched = time.time()
    wall_s, peak_pss, stop_s = train(args.minutes, args.config, train_dir, extra)
    steps = trainer_steps(train_dir)
    rows = read_metrics(train_dir / "metrics" / "rollout.jsonl")
    batches = [r for r in rows if r.get("event") == "batch"]
    made = speed(steps, wall_s)
    zero_var = sum(r["charts/zero_variance_groups"] for r in steps)
    groups = sum(len(r["trained_group_ids"]) for r in steps)
    informative = sum(r["charts/trained_samples"] for r in steps)
    saved = sorted(
        (read_checkpoint_meta(d)["time"] - launched, d)
        for d in (train_dir / "checkpoints").glob("v*")
        if (d / "agentjet.json").exists()
    )
    points = []
    for mark in marks:
        before_mark = [(t, d) for t, d in saved if t <= mark * 60]
        if before_mark:
            t, d = before_mark[-1]
            points.append({"mark": mark, "minutes": round(t / 60, 2), "checkpoint": str(d),
                           "version": read_checkpoint_meta(d)["policy_version"]})  # fmt: skip
    return {
        "minutes": round(wall_s / 60, 2),
        **made,
        "gen_tokens_per_s": gen_tokens_per_s(batches),
        "s_per_policy_version": round(wall_s / max(made["policy_versions"], 1), 2),
        "zero_variance_group_frac": round(zero_var / max(groups, 1), 3),
        # Samples trained with a non-zero advantage (the gradient's), per second of wall time.
        "effective_samples_per_s": round(informative / wall_s, 3),
        # Peak memory as proportional set size (see memory_mb), sampled every 2 s: of all
        # roles together, and each role's own peak (memory_by_role).
        "peak_pss_mb": {key: round(mb, 1) for key, mb in peak_pss.items()},
        "ctrl_c_exit_s": round(stop_s, 1),  # SIGINT to the launcher's exit
        "points": points,
    }


def drop_checkpoints(train_dir: Path) -> None:
    """Every checkpoint of a scored run but its last (0.5 GB each)."""
    newest = final_checkpoint(train_dir)
    for d in (train_dir / "checkpoints").glob("v*"):
        if d != newest:
            shutil.rmtree(d, ignore_errors=True)


def gen_tokens_per_s(batches: list[dict]) -> float:
    """Tokens generated per second inside the rollout node's batches (its "batch" rows)."""
    gen_s = sum(r["perf/batch_s"] for r in batches)
    gen_tokens = sum(r["perf/gen_tokens_per_s"] * r["perf/batch_s"] for r in batches)
    return round(gen_tokens / gen_s, 2) if gen_s else 0.0


def run_facts(args: argparse.Namespace) -> dict[str, object]:
    """What a result was run with, and where and when."""
    return {
        "config": str(args.config.relative_to(ROOT)),
        "overrides": args.set,
        **({"score_overrides": args.score_set} if args.score_set else {}),
        "machine": f"{os.cpu_count()} CPU cores",
        "date": time.strftime("%Y-%m-%d"),
    }


def trainer_steps(run_dir: Path) -> list[dict]:
    """The trainer's "step" rows of a finished `train` run."""
    rows = read_metrics(run_dir / "metrics" / "trainer.jsonl")
    return [r for r in rows if r.get("event") == "step"]


def speed(steps: list[dict], wall_s: float) -> dict[str, float]:
    """Versions made and samples trained per second, from a run's `trainer_steps`."""
    return {
        "policy_versions": len({r["policy_version"] for r in steps}),
        "samples_per_s": round(sum(r["charts/samples"] for r in steps) / wall_s, 3),
    }


def memory_only(args: argparse.Namespace, run_dir: Path) -> int:
    extra = [a for s in args.set for a in ("--set", s)]
    wall_s, peak_pss, stop_s = train(args.minutes, args.config, run_dir / "train", extra)
    result = {
        "minutes": round(wall_s / 60, 2),
        **speed(trainer_steps(run_dir / "train"), wall_s),
        "peak_pss_mb": {key: round(mb, 1) for key, mb in peak_pss.items()},
        "ctrl_c_exit_s": round(stop_s, 1),  # SIGINT to the launcher's exit
        **run_facts(args),
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
