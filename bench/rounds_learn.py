"""Learning per trained sample: exact gradient rounds against local steps (issue 51 item 4).

    held-out tasks (bench/learn.py's: seed 12345) ──eval base──▶ base
    per mode, per seed (the same seeds for every mode: paired):
        agentjet coordinator --listen 127.0.0.1:P                  ──▶ prints the --join address
        agentjet node --role trainer --join ... --listen ...        trainer-a
        agentjet node --role trainer --join ... --listen ...        trainer-b
        agentjet node --role rollout --join ...                     rollout
      each with --config: configs/local.toml (the README's `./just local`: the embedded
      SmolLM2-135M) + run.seed=SEED + the mode's settings + --set ...; on this box, loopback
      until the two trainers together have trained --samples samples (their step rows'
      trained_group_ids x rollout.group_size: a group counts once a version holds it), then
      SIGINT to the three nodes at once, to the coordinator once they are gone
      ──eval trainer-a's final checkpoint greedily on the held-out tasks──▶ after
    ──▶ bench/results/rounds_learn.json: per mode and seed, per mode the mean, and per seed
        the paired difference of each mode against "exact" (points), with its mean

Modes (settings on every node):
    exact         swarm.grad_compression=none, swarm.local_steps=1 (the defaults): one exact
                  fp32 round averages the trainers' gradients at every version
    local_steps   swarm.local_steps=4, swarm.grad_compression=fp16: DiLoCo's inner AdamW
                  steps, then one fp16 round of pseudo-gradients and the outer Nesterov step
                  (node/local_steps.py); a version is 4x the samples of an exact one
    uint8         swarm.grad_compression=uint8 (only when --modes names it)

run.seed is the run's one seed (agentjet/config_schema.py RunConfig): the coordinator's task
draws, the rollout node's sampling and ledger, the trainer's torch seed. The run stops at the
first poll after the budget is reached, so a version or two more may be in the checkpoint:
its samples are reported beside the budget ("samples_at_checkpoint"). Every process is
reaped by PID (tests/integration/test_swarm.py Swarm: each in its own session, killed with
this process); a run's folder is removed once evaluated and kept (its path printed) when it
fails. The box is shared: each swarm starts once NEED_GB of memory is free (or after
--memory-wait-s), and one that fails (a trainer OOM-killed) is run again, up to --retries;
`--resume` keeps the base and the runs --out already holds.

Run: `just bench-rounds-learn` (or `.venv/bin/python bench/rounds_learn.py [--samples 1024]
[--seeds 0 1 2] [--modes exact local_steps] [--heldout 300] [--set KEY=VALUE ...]`);
`--quick`: one seed, 128 samples, 20 held-out tasks, a smoke test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learn import HELDOUT_SEED, evaluate, final_checkpoint, make_heldout, run_facts  # noqa: E402
from links_swarm import stop  # noqa: E402
from links_swarm import watch as watch_swarm  # noqa: E402
from swarm import BenchError  # noqa: E402  (what links_swarm's watch raises)

from agentjet.config import Config, load_config, to_toml  # noqa: E402
from tests.integration.test_swarm import (  # noqa: E402
    Swarm,
    check_every_group_accounted_for,
    free_listen,
    leftovers,
)

BASE_CONFIG = ROOT / "configs" / "local.toml"
MODES: dict[str, list[str]] = {
    "exact": ["swarm.grad_compression=none", "swarm.local_steps=1"],
    "local_steps": ["swarm.local_steps=4", "swarm.grad_compression=fp16"],
    "uint8": ["swarm.grad_compression=uint8"],
}
TRAINERS = ("trainer-a", "trainer-b")
ROLLOUT, COORDINATOR = "rollout", "coordinator"
NODES = (*TRAINERS, ROLLOUT)
# Until the budget is trained: model loads, the rollout node's held-out evaluation at v0 and
# the versions themselves, on a 2-core box other benchmarks share.
RUN_TIMEOUT_S = 45 * 60.0
PROGRESS_S = 60.0
# Free memory a swarm waits for before it starts, per mode (peaks measured here: trainers of
# 4.3 GB each in exact mode, their inner AdamW and anchor on top with local steps, a rollout
# node of 1.7 GB); --need-gb overrides.
NEED_GB = {"exact": 13.0, "local_steps": 16.0, "uint8": 13.0}
# Free memory must last this long before a swarm starts (another benchmark's run between
# its phases frees it for a moment).
MEMORY_SETTLE_S = 60.0


class LearnSwarm(Swarm):
    """tests/integration/test_swarm.py's Swarm (start, metrics, steps, stuck, reap) over
    this bench's config: its constructor writes the tests' tiny-model config, replaced."""

    def __init__(self, folder: Path, config: Config) -> None:
        super().__init__(folder, Path(config.model.name), ())
        self.config_path.write_text(to_toml(config))
        self.group_size = config.rollout.group_size

    def samples_trained(self) -> int:
        """Samples of the groups both trainers' versions hold so far."""
        return sum(len(r["trained_group_ids"]) for t in TRAINERS for r in self.steps(t)) * (
            self.group_size
        )


def run_config(settings: list[str]) -> Config:
    """configs/local.toml with `settings`; its relative paths (the rollout node's held-out
    task file) are the repository root's, where every node runs."""
    with contextlib.chdir(ROOT):
        return load_config(BASE_CONFIG, settings)


def start(swarm: LearnSwarm) -> None:
    """The coordinator, then two trainers and a rollout node joining it, as the README's
    commands start them on machines of their own (here all on loopback)."""
    swarm.start(COORDINATOR, "coordinator", "--listen", free_listen())
    join = swarm.join_address()
    for name in TRAINERS:
        swarm.start(name, "node", "--role", "trainer", "--join", join, "--listen", free_listen())
    swarm.start(ROLLOUT, "node", "--role", "rollout", "--join", join)


def watch(swarm: LearnSwarm, until: Callable[[], bool], limit_s: float, what: str) -> None:
    """bench/links_swarm.py's `watch` (poll until `until()`; fail when a process exits or
    `limit_s` passes), printing the samples trained every PROGRESS_S."""
    began = shown = time.monotonic()

    def showing() -> bool:
        nonlocal shown
        now = time.monotonic()
        if now - shown >= PROGRESS_S:
            shown = now
            versions = max(swarm.version(t) for t in TRAINERS)
            print(
                f"  {(now - began) / 60:.1f} min: {swarm.samples_trained()} samples, "
                f"version {versions}",
                flush=True,
            )
        return until()

    watch_swarm(swarm, showing, limit_s, what)


def groups(swarm: LearnSwarm) -> dict[str, Any]:
    """Every group the rollout node made: trained once, dropped as stale or still held
    (test_swarm's check; "lost" says which check failed, if one did)."""
    try:
        return check_every_group_accounted_for(swarm, list(TRAINERS))
    except (AssertionError, ValueError, KeyError) as e:
        return {"lost": str(e) or type(e).__name__}


def rounds(swarm: LearnSwarm) -> dict[str, int]:
    """The trainers' round counts (node/swarm.py `counts`) and requeued groups, summed over
    both from each one's last step row."""
    total: dict[str, int] = {}
    for name in TRAINERS:
        steps = swarm.steps(name)
        if not steps:
            continue
        for key, value in steps[-1].items():
            if key.startswith("counts/swarm_") or key == "counts/groups_requeued":
                short = key.removeprefix("counts/").removeprefix("swarm_")
                total[short] = total.get(short, 0) + int(value)
    return total


def final(folder: Path) -> tuple[Path, str]:
    """trainer-a's final checkpoint, else trainer-b's (a trainer OOM-killed while it saved
    leaves none; every trainer holds the same weights at a version): the checkpoint, and
    whose it is."""
    for name in TRAINERS:
        if (folder / name / "checkpoints" / "latest").exists():
            return final_checkpoint(folder / name), name
    raise BenchError(f"no trainer saved a checkpoint (logs in {folder})")


def train(folder: Path, config: Config, samples: int) -> dict[str, Any]:
    """The swarm in `folder` until its trainers trained `samples` samples, then stopped;
    what it did, with trainer-a's final checkpoint ("checkpoint")."""
    swarm = LearnSwarm(folder, config)
    launched = time.monotonic()
    try:
        start(swarm)
        watch(swarm, lambda: bool(swarm.steps(TRAINERS[0])), RUN_TIMEOUT_S, "before a step")
        first_step_s = time.monotonic() - launched
        watch(
            swarm,
            lambda: swarm.samples_trained() >= samples,
            RUN_TIMEOUT_S - first_step_s,
            f"training {samples} samples",
        )
        reached_s = time.monotonic() - launched
        trained_at_stop = swarm.samples_trained()
        codes, stop_s = stop(swarm, NODES)
        left = leftovers(swarm)
    finally:
        swarm.reap()
    checkpoint, evaluated = final(folder)
    version = int(checkpoint.name.lstrip("v"))
    held = [r for t in TRAINERS for r in swarm.steps(t) if r["policy_version"] <= version]
    return {
        "checkpoint": checkpoint,
        "checkpoint_version": version,
        "checkpoint_of": evaluated,
        "samples_trained": swarm.samples_trained(),
        "samples_at_stop": trained_at_stop,
        "samples_at_checkpoint": sum(len(r["trained_group_ids"]) for r in held) * swarm.group_size,
        "versions": {t: swarm.version(t) for t in TRAINERS},
        "minutes": round(reached_s / 60, 2),
        "first_step_minutes": round(first_step_s / 60, 2),
        "groups": groups(swarm),
        "rounds": rounds(swarm),
        "exit_codes": codes,
        "stop_s": stop_s,
        "leftover_processes": left,
    }


def mem_available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def wait_for_memory(need_gb: float, limit_s: float) -> float:
    """Wait (up to `limit_s`) until `need_gb` of memory has been available for MEMORY_SETTLE_S
    on end: the box is shared with other benchmarks, and the kernel's OOM killer ends a
    trainer that does not fit. The memory available when the wait ends."""
    deadline = time.monotonic() + limit_s
    settled = time.monotonic()
    noted = False
    while time.monotonic() < deadline:
        available = mem_available_gb()
        if available < need_gb:
            settled = time.monotonic()
            if not noted:
                print(f"  waiting for {need_gb:g} GB of memory ({available:.1f} GB)", flush=True)
                noted = True
        elif time.monotonic() - settled >= MEMORY_SETTLE_S:
            break
        time.sleep(5)
    return round(mem_available_gb(), 1)


def one_run(
    mode: str, seed: int, args: argparse.Namespace, tasks: Path, work: Path
) -> dict[str, Any]:
    """One mode at one seed: trained, stopped, trainer-a's checkpoint evaluated; a swarm
    that fails (a process killed by the OOM killer on this shared box, a run past its
    limit) is run again from the start, up to --retries times."""
    settings = [f"run.seed={seed}", f"swarm.run_id=rounds-learn-{mode}-{seed}"]
    settings += [*MODES[mode], *args.set]
    failures: list[str] = []
    began = time.monotonic()
    while True:
        memory = wait_for_memory(args.need_gb or NEED_GB[mode], args.memory_wait_s)
        folder = Path(tempfile.mkdtemp(prefix=f"rounds-learn-{mode}-{seed}-", dir=work))
        print(f"{mode} seed {seed}: {folder} ({memory} GB free)", flush=True)
        try:
            done = train(folder, run_config(settings), args.samples)
            break
        except BenchError as e:
            print(f"rounds_learn: {mode} seed {seed} failed: {e}", flush=True)
            failures.append(str(e))
            # its logs stay for a look; its checkpoints (0.5 GB each) go
            for checkpoints in folder.glob("*/checkpoints"):
                shutil.rmtree(checkpoints)
            if len(failures) > args.retries:
                raise
    try:
        after = evaluate(str(done.pop("checkpoint")), tasks, BASE_CONFIG)
    except BaseException:
        print(f"rounds_learn: {mode} seed {seed} failed; its files are in {folder}", flush=True)
        raise
    shutil.rmtree(folder)
    result = {
        "after": {k: after[k] for k in ("overall", "mean_reward", "by_difficulty", "n")},
        **done,
        "wall_minutes": round((time.monotonic() - began) / 60, 2),
        "mem_available_gb_at_start": memory,
        "failed_attempts": failures,
        "settings": settings,
    }
    print(
        f"{mode} seed {seed}: {after['overall']:.4f} after {done['samples_at_checkpoint']} "
        f"samples (v{done['checkpoint_version']}), {done['minutes']} min",
        flush=True,
    )
    return result


def points(value: float) -> float:
    return round(100 * value, 2)


def summarize(result: dict[str, Any]) -> None:
    """Per mode the mean accuracy; per other mode the paired difference against exact."""
    runs = result["runs"]
    result["mean"] = {
        mode: round(statistics.mean(r["after"]["overall"] for r in by_seed.values()), 4)
        for mode, by_seed in runs.items()
        if by_seed
    }
    result["paired_diff_points"] = {}
    exact = runs.get("exact", {})
    for mode, by_seed in runs.items():
        if mode == "exact":
            continue
        diffs = {
            seed: points(r["after"]["overall"] - exact[seed]["after"]["overall"])
            for seed, r in by_seed.items()
            if seed in exact
        }
        if diffs:
            mean = round(statistics.mean(diffs.values()), 2)
            result["paired_diff_points"][f"{mode}-exact"] = {"per_seed": diffs, "mean": mean}


def print_table(result: dict[str, Any]) -> None:
    base = result["base"]["overall"]
    print(f"\nheld-out greedy accuracy ({result['heldout']} tasks), base {points(base)}%")
    seeds = sorted({s for by_seed in result["runs"].values() for s in by_seed}, key=int)
    print(f"{'mode':<12}" + "".join(f"{'seed ' + s:>10}" for s in seeds) + f"{'mean':>10}")
    for mode, by_seed in result["runs"].items():
        cells = [
            f"{points(by_seed[s]['after']['overall']):>10}" if s in by_seed else f"{'-':>10}"
            for s in seeds
        ]
        mean = result["mean"].get(mode)
        print(f"{mode:<12}" + "".join(cells) + f"{points(mean) if mean is not None else '-':>10}")
    for name, diff in result["paired_diff_points"].items():
        cells = [f"{diff['per_seed'].get(s, '-'):>10}" for s in seeds]
        print(f"{name:<12}" + "".join(cells) + f"{diff['mean']:>10}")


def write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def resumed(args: argparse.Namespace) -> dict[str, Any]:
    """With --resume, --out's result when it was made with this budget and held-out set
    (its base and finished runs are kept), else nothing."""
    if not args.resume or not args.out.exists():
        return {}
    earlier = json.loads(args.out.read_text())
    if (earlier["samples_budget"], earlier["heldout"]) != (args.samples, args.heldout):
        return {}
    kept = {mode: sorted(runs, key=int) for mode, runs in earlier["runs"].items()}
    print(f"resumed from {args.out}: base and runs {kept}", flush=True)
    return earlier


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1024, help="budget, both trainers")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run.seed")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["exact", "local_steps"])
    parser.add_argument("--heldout", type=int, default=300, help="held-out tasks")
    parser.add_argument("--set", action="append", default=[], help="config KEY=VALUE, each node")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "rounds_learn.json"
    )
    parser.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()), help="runs' folders here"
    )
    parser.add_argument("--retries", type=int, default=5, help="a failed swarm run again")
    parser.add_argument(
        "--need-gb", type=float, default=None, help="free memory to wait for (NEED_GB)"
    )
    parser.add_argument("--memory-wait-s", type=float, default=900.0, help="at most")
    parser.add_argument("--quick", action="store_true", help="1 seed, 128 samples, 20 tasks")
    parser.add_argument(
        "--resume", action="store_true", help="keep --out's base and runs (same budget, tasks)"
    )
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.samples, args.heldout = args.seeds[:1], 128, 20
    if HELDOUT_SEED in args.seeds:
        parser.error(f"seed {HELDOUT_SEED} makes the held-out tasks")

    began = time.monotonic()
    args.work.mkdir(parents=True, exist_ok=True)
    held_dir = Path(tempfile.mkdtemp(prefix="rounds-learn-heldout-", dir=args.work))
    tasks = make_heldout(held_dir, args.heldout)
    earlier = resumed(args)
    result: dict[str, Any] = {
        "samples_budget": args.samples,
        "heldout": args.heldout,
        "heldout_seed": HELDOUT_SEED,
        "seeds": args.seeds,
        "seed_key": "run.seed",
        "modes": {mode: MODES[mode] for mode in args.modes},
        "base": earlier.get("base"),
        "runs": {mode: earlier.get("runs", {}).get(mode, {}) for mode in args.modes},
    }
    if result["base"] is None:
        base = evaluate("base", tasks, BASE_CONFIG)
        result["base"] = {k: base[k] for k in ("overall", "mean_reward", "by_difficulty", "n")}
    print(f"base: {result['base']['overall']:.4f} on {args.heldout} held-out tasks", flush=True)
    facts = run_facts(argparse.Namespace(config=BASE_CONFIG, set=args.set))
    for seed in args.seeds:  # seed by seed: a cut-short bench still has pairs
        for mode in args.modes:
            if str(seed) in result["runs"][mode]:
                continue
            result["runs"][mode][str(seed)] = one_run(mode, seed, args, tasks, args.work)
            summarize(result)
            result["wall_minutes"] = round(
                earlier.get("wall_minutes", 0) + (time.monotonic() - began) / 60, 2
            )
            write(args.out, result | {"facts": facts})
    summarize(result)
    shutil.rmtree(held_dir)
    print_table(result)
    print(f"\nwall: {result['wall_minutes']} min; written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
