"""Where `agentjet eval` of a prompt environment spends its time, and torch's thread count
side by side: the same rows, one process, arms alternated (ABAB) on a shared, noisy box.

    task file + reward ──▶ the prompt environment and the engine (as node/evaluate.py makes them)
        per round, per arm (torch threads: "default" = torch's own, every core, as `agentjet
        eval` ran before it set rollout.torch_threads; "config" = rollout.torch_threads):
            play_rewards over the rows in chunks of --batch-size (greedy, one answer a task)
            ──▶ generation seconds and tokens (engine.generate timed), reward seconds
                (Rewards.score timed), total seconds

Also reported: the rows' prompt lengths in tokens (chat template included), the share of
answers cut at max_new_tokens, and the load average before and after (the box is shared).

The rows, by default, are as the issue's user made them: reasoning-gym's `leg_counting`
written to JSONL from reasoning_gym.create_dataset (seed 1), scored by reasoning-gym's own
scorer (`reasoning_gym_score` below); --tasks and --reward name another file and function.

    PYTHONPATH=$PWD .venv/bin/python bench/eval_speed.py --rows 24 --rounds 2

Writes bench/results/eval_speed.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from agentjet.config import load_config
from agentjet.episode import SamplingParams
from agentjet.task_files import load_tasks
from node.engine import open_engine
from node.evaluate import play_rewards
from node.model import resolve_model
from sandboxes.envs import make_env
from sandboxes.envs.chat import chat_prompt_ids
from sandboxes.envs.prompt import PromptEnv

RESULTS = Path(__file__).parent / "results" / "eval_speed.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=Path, help="a prompt task file (default: reasoning-gym)")
    parser.add_argument("--reward", default="bench.eval_speed:reasoning_gym_score")
    parser.add_argument("--rg-task", default="leg_counting", help="the reasoning-gym rows")
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=1, help="ABAB rounds of the two arms")
    parser.add_argument("--batch-size", type=int, default=64, help="as agentjet eval's")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.tasks is None:
        args.tasks = Path(tempfile.mkdtemp()) / f"{args.rg_task}.jsonl"
        write_reasoning_gym_rows(args.tasks, args.rg_task, args.rows)

    config = load_config(
        None,
        [
            'envs.0.name="prompt"',
            f"envs.0.task_file={json.dumps(str(args.tasks))}",
            f"envs.0.reward={json.dumps(args.reward)}",
            f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
        ],
    )
    tasks = load_tasks(args.tasks, "prompt").tasks[: args.rows]
    env = make_env(config.envs[0])
    assert isinstance(env, PromptEnv)
    default_threads = torch.get_num_threads()
    path = resolve_model(config.model.name, config.model.cache_dir)
    engine = open_engine(config.model, config.rollout, path, config.run.seed)
    lengths = [len(chat_prompt_ids(engine.tokenizer, None, t)) for t in tasks]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, greedy=True)
    arms = {"default": default_threads, "config": config.rollout.torch_threads}
    load_before = os.getloadavg()[0]
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for arm, threads in arms.items():
            torch.set_num_threads(threads)
            run = asyncio.run(_timed(env, engine, tasks, params, args.batch_size))
            run |= {"arm": arm, "threads": threads, "round": round_}
            runs.append(run)
            print(json.dumps(run), flush=True)
    engine.close()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "tasks": str(args.tasks),
        "rows": len(tasks),
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "prompt_tokens": {"mean": round(statistics.mean(lengths), 1), "max": max(lengths)},
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def write_reasoning_gym_rows(path: Path, name: str, rows: int) -> None:
    """`rows` rows of reasoning-gym's `name` as a prompt task file (what a user writes)."""
    import reasoning_gym

    with path.open("w") as f:
        for i, row in enumerate(reasoning_gym.create_dataset(name, size=rows, seed=1)):
            line = {"id": f"{name}-{i}", "prompt": row["question"], "answer": row["answer"]}
            f.write(json.dumps(line | {"metadata": row["metadata"]}) + "\n")


def reasoning_gym_score(task: dict[str, Any], completion: str) -> float:
    """reasoning-gym's own scorer for the row's dataset, as a prompt reward function."""
    import reasoning_gym

    entry = {"question": task["prompt"], "answer": task["answer"], "metadata": task["metadata"]}
    name = task["metadata"]["source_dataset"]
    return float(reasoning_gym.get_score_answer_fn(name)(completion, entry))


async def _timed(
    env: PromptEnv, engine: Any, tasks: list[Any], params: SamplingParams, batch_size: int
) -> dict[str, Any]:
    """One arm: play_rewards as `agentjet eval` plays it, generation and scoring timed."""
    spent = {"generate_s": 0.0, "reward_s": 0.0, "tokens": 0, "cut": 0, "answers": 0}
    generate, score = engine.generate, env.rewards.score

    async def timed_generate(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        out = await generate(*a, **kw)
        spent["generate_s"] += time.perf_counter() - start
        for samples in out:
            for completion in samples:
                spent["tokens"] += len(completion.token_ids)
                spent["cut"] += completion.finish_reason == "length"
                spent["answers"] += 1
        return out

    async def timed_score(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return await score(*a, **kw)
        finally:
            spent["reward_s"] += time.perf_counter() - start

    engine.generate, env.rewards.score = timed_generate, timed_score  # type: ignore[method-assign]
    start = time.perf_counter()
    try:
        rewards = await play_rewards(env, engine, tasks, 1, params, batch_size)
    finally:
        del engine.generate, env.rewards.score  # the instance's own, back to the class's
    total = time.perf_counter() - start
    return {
        "total_s": round(total, 1),
        "generate_s": round(spent["generate_s"], 1),
        "reward_s": round(spent["reward_s"], 3),
        "tokens": spent["tokens"],
        "tokens_per_s": round(spent["tokens"] / max(spent["generate_s"], 1e-9), 1),
        "cut_at_max_new_tokens": round(spent["cut"] / max(spent["answers"], 1), 3),
        "mean_reward": round(statistics.mean(r[0] if r else 0.0 for r in rewards), 3),
        "load": round(os.getloadavg()[0], 2),
    }


if __name__ == "__main__":
    main()
