"""Which reasoning-gym tasks the base model half solves: greedy held-out accuracy of
SmolLM2-135M (configs/local.toml's model) on small configs of reasoning-gym datasets, to
pick tasks that RL can move (base accuracy 10-60%: mixed groups, room to learn).

    per candidate (dataset, config): a "reasoning_gym" env of that one entry
        ──▶ its first --rows held-out rows (GymTasks.held_out, task_seed 0)
        ──▶ greedy, one answer each, max_new_tokens as configs/local.toml, played and
            scored as training plays them (sandboxes/envs/reasoning_gym.py)
        ──▶ {"task", "config", "n", "accuracy" (reward 1), "mean_reward", "seconds"}
    ──▶ bench/results/rg_scan.json (written after every candidate)

Run: `just rg-scan` (or `.venv/bin/python bench/rg_scan.py --rows 40 --only gcd,products`):
40 rows took 83-567 s a candidate on a shared 2-core box (one engine batch each).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentjet.config import ReasoningGymTask, load_config  # noqa: E402
from agentjet.episode import SamplingParams  # noqa: E402
from agentjet.tasks import held_out_tasks  # noqa: E402
from node.engine import open_engine  # noqa: E402
from node.evaluate import play_rewards, summarize  # noqa: E402
from node.model import resolve_model  # noqa: E402
from sandboxes.envs import make_env  # noqa: E402

RESULT = ROOT / "bench" / "results" / "rg_scan.json"
# Small configs of easy datasets, likeliest in range first.
CANDIDATES: list[tuple[str, dict[str, Any]]] = [
    ("leg_counting", {"min_animals": 1, "max_animals": 1, "max_instances": 3}),
    (
        "basic_arithmetic",
        {
            "min_terms": 2,
            "max_terms": 2,
            "max_digits": 1,
            "operators": ["+", "-"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
    ),  # fmt: skip
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "max_digits": 1}),
    ("products", {"max_digits": 1}),
    ("letter_counting", {"min_words": 1, "max_words": 3}),
    ("gcd", {"max_value": 20}),
    ("lcm", {"max_value": 10}),
    ("count_bits", {"max_n": 16}),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=40, help="held-out rows per candidate")
    parser.add_argument("--answer", default="tags_or_last_number", help="envs[].rg_answer")
    parser.add_argument("--system-prompt", default="model", help="envs[].rg_system_prompt")
    parser.add_argument("--only", default="", help="comma-separated dataset names to scan")
    args = parser.parse_args()
    config = load_config(ROOT / "configs" / "local.toml")
    path = resolve_model(config.model.name, config.model.cache_dir)
    engine = open_engine(config.model, config.rollout, path, config.run.seed)
    params = SamplingParams(max_new_tokens=config.rollout.sampling.max_new_tokens, greedy=True)
    only = set(filter(None, args.only.split(",")))
    results: list[dict[str, Any]] = []
    for name, settings in CANDIDATES:
        if only and name not in only:
            continue
        env = load_config(ROOT / "configs" / "local.toml").envs[0]
        env.name, env.eval_file, env.eval_rows = "reasoning_gym", "", args.rows
        env.tasks = [ReasoningGymTask(name=name, config=settings)]
        env.rg_answer, env.rg_system_prompt = args.answer, args.system_prompt  # type: ignore[assignment]
        tasks = held_out_tasks(env)
        start = time.perf_counter()
        rewards = uvloop.run(play_rewards(make_env(env), engine, tasks, 1, params, len(tasks)))
        summary = summarize(tasks, rewards, 1)
        results.append({
            "task": name, "config": settings, "n": summary["n"],
            "accuracy": summary["overall"], "mean_reward": summary["mean_reward"],
            "greedy": True, "seconds": round(time.perf_counter() - start, 1),
        })  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
        RESULT.write_text(json.dumps({
            "model": config.model.name, "rg_answer": args.answer,
            "rg_system_prompt": args.system_prompt,
            "max_new_tokens": params.max_new_tokens, "held_out": "rows [train_rows, "
            "train_rows + n) of task_seed 0", "host": platform.node(),
            "date": time.strftime("%Y-%m-%d"), "results": results,
        }, indent=2) + "\n")  # fmt: skip
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
