"""What the default held-out curve costs: `agentjet local` (configs/local.toml) with its
held-out evaluation (`rollout.eval_every`, 54 greedy tasks every 30 versions) against the
same run with it off (`rollout.eval_every=0`), side by side in one run, alternating
(on, off, on, off, ...) so the box's drift falls on both arms alike.

    for each pair: bench/learn.py's training (--minutes, then Ctrl-C), eval on; then off
    ──▶ samples/s and versions per run, the eval rows' own seconds
    ──▶ bench/results/heldout_cost.json: each arm's mean, and off/on - 1 (the drop)

Run: `just bench-heldout-cost` (or `.venv/bin/python bench/heldout_cost.py --pairs 2
--minutes 8`). The target (issue 48): the curve costs under 5% of samples/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from learn import run_facts, speed, train, trainer_steps, write_result  # noqa: E402

from agentjet.metrics import read_metrics  # noqa: E402

ARMS = {"eval_on": [], "eval_off": ["--set", "rollout.eval_every=0"]}


def one_run(minutes: float, config: Path, run_dir: Path, extra: list[str]) -> dict[str, float]:
    wall_s, peak_pss, _ = train(minutes, config, run_dir, extra)
    evals = [
        r for r in read_metrics(run_dir / "metrics" / "rollout.jsonl") if r.get("event") == "eval"
    ]
    eval_s = sum(r["eval/seconds"] for r in evals)
    return {
        **speed(trainer_steps(run_dir), wall_s),
        "wall_s": round(wall_s, 1),
        "evals": len(evals),
        "eval_s": round(eval_s, 1),
        "eval_share": round(eval_s / wall_s, 4),
        "peak_pss_mb": round(peak_pss["total"], 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.toml")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "heldout_cost.json"
    )
    parser.add_argument("--set", action="append", default=[], help="override, every run")
    args = parser.parse_args()
    extra = [a for s in args.set for a in ("--set", s)]
    base = ROOT / "runs" / f"bench-heldout-cost-{time.strftime('%Y%m%d-%H%M%S')}"
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for pair in range(args.pairs):
        for arm, arm_set in ARMS.items():
            run_dir = base / f"{arm}-{pair}"
            result = one_run(args.minutes, args.config, run_dir, extra + arm_set)
            print(arm, pair, json.dumps(result), flush=True)
            runs[arm].append(result)
    means = {
        arm: {
            key: round(mean(r[key] for r in rows), 3)
            for key in ("samples_per_s", "policy_versions", "eval_share")
        }
        for arm, rows in runs.items()
    }
    on, off = means["eval_on"]["samples_per_s"], means["eval_off"]["samples_per_s"]
    write_result(
        args.out,
        {
            "runs": runs,
            "means": means,
            # > 0: the run with the held-out curve made fewer samples per second
            "samples_per_s_drop": round(1 - on / off, 4) if off else None,
            "minutes": args.minutes,
            "pairs": args.pairs,
            **run_facts(args),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
