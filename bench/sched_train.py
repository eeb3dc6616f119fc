"""Scheduling benchmark: EnvSched vs uniform on real training of SmolLM2-135M.

    held-out tasks (seed 12345) ── for scheduler in (uniform, envsched), same seeds:
        agentjet local --config configs/local.toml --set coordinator.scheduler=S  (--minutes)
        ──▶ zero-variance fraction of trained groups, effective (non-zero-advantage)
            samples per second, held-out accuracy of the final checkpoint
    ──▶ bench/results/sched.json

Run: `just bench-sched` (or `.venv/bin/python bench/sched_train.py --minutes 15`). Both runs
train on the same mixed arithmetic set (all three difficulties, all three ops), with the
same update size: a policy version is `trainer.informative_samples_per_step` samples that
carry gradient (SHARED_SETTINGS), not a number of groups. With a fixed number of groups
per version, a scheduler that makes more groups informative makes every step longer and
the run gets fewer versions for the same wall time (bench/LOG.md, first run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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

SCHEDULERS = ("uniform", "envsched")
# Both arms: train every 4 groups, step the optimizer every 24 samples with gradient
# (what 8 uniform groups hold on average at the start of training).
SHARED_SETTINGS = ("trainer.groups_per_step=4", "trainer.informative_samples_per_step=24")


def summarize(run_dir: Path, wall_s: float, heldout: dict) -> dict:
    steps = [
        r for r in read_metrics(run_dir / "metrics" / "trainer.jsonl") if r.get("event") == "step"
    ]
    groups = sum(len(r["trained_group_ids"]) for r in steps)
    zero = sum(r["charts/zero_variance_groups"] for r in steps)
    effective = sum(r["charts/trained_samples"] for r in steps)
    return {
        "zero_variance_frac": round(zero / max(groups, 1), 4),
        "effective_samples_per_s": round(effective / wall_s, 4),
        "heldout_accuracy": heldout["overall"],
        "heldout_by_difficulty": heldout["by_difficulty"],
        "policy_versions": len({r["policy_version"] for r in steps}),
        "groups_trained": groups,
        "wall_s": round(wall_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--heldout", type=int, default=300)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.toml")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sched.json")
    parser.add_argument(
        "--set", action="append", default=list(SHARED_SETTINGS), help="for both arms"
    )
    args = parser.parse_args()

    root = ROOT / "runs" / f"bench-sched-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True)
    tasks = make_heldout(root, args.heldout)
    result: dict = {"minutes": args.minutes, "heldout_seed": HELDOUT_SEED, "settings": args.set}
    shared = [arg for setting in args.set for arg in ("--set", setting)]
    for scheduler in SCHEDULERS:
        run_dir = root / scheduler
        wall_s, _ = train(
            args.minutes,
            args.config,
            run_dir,
            [*shared, "--set", f'coordinator.scheduler="{scheduler}"'],
        )
        heldout = evaluate(str(final_checkpoint(run_dir)), tasks, args.config)
        result[scheduler] = summarize(run_dir, wall_s, heldout)
        print(scheduler, json.dumps(result[scheduler]), flush=True)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
