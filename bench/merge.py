"""Timeline-merging benchmark: trained tokens and trainer step time, merged vs unmerged.

    react environment (the built-in agent on the OpenAI endpoint, SmolLM2-135M, python
    tool in process sandboxes) plays --tasks × --group episodes; every episode's calls are
    turned into training groups twice, from the very same calls:
        merged:   agentjet.timeline.merge_calls(calls)               (one sequence per episode)
        unmerged: agentjet.timeline.merge_calls(calls, merge=False)  (one per call)
    ──▶ tokens the learner forwards (all episodes), and Learner.train_step time on the
        first --step-groups groups of each (a CPU step on every episode takes many minutes)
        ──▶ bench/results/merge.json

The learner skips samples without advantage, and a 135M model rarely earns a reward
here, so for the step-time measurement each group's rewards are set to 1, 0, 1, 0, ...
(every sequence then carries gradient, as in a group that teaches something); the token
counts do not depend on rewards. The real mean reward is reported too.

Run: `just bench-merge` (or `.venv/bin/python bench/merge.py --tasks 8`), machine idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from agentjet import protocol  # noqa: E402
from agentjet.config import EMBEDDED_MODEL, SwarmConfig, TrainerConfig, load_config  # noqa: E402
from agentjet.episode import Episode, SamplingParams  # noqa: E402
from agentjet.tasks import TaskSource  # noqa: E402
from agentjet.timeline import merge_calls  # noqa: E402
from node.agents import AgentEnv, Played  # noqa: E402
from node.learner import Learner  # noqa: E402
from node.model import load_causal_lm, resolve_model  # noqa: E402
from node.rollout_produce import build_group  # noqa: E402
from node.swarm import SwarmOptimizer  # noqa: E402
from node.torch_engine import TorchEngine  # noqa: E402
from sandboxes.envs.react import ReactAgent  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "merge.json"


def groups_of(played: list[list[Played]], merge: bool) -> list[protocol.TrajectoryGroup]:
    """Training groups of the played episodes, rewards alternating (module docstring)."""
    groups = []
    for i, group in enumerate(played):
        episodes = []
        for j, p in enumerate(group):
            sequences = merge_calls(p.calls, merge=merge)
            episodes.append(
                Episode(
                    prompt_ids=sequences[0].prompt_ids,
                    reward=float(j % 2 == 0),
                    turns=len(p.calls),
                    policy_version=0,
                    sequences=sequences,
                )
            )
        task = protocol.Task(id=f"t{i}", env="react", prompt="")
        grant = protocol.WorkGrant(grant_id=f"g{i}", task=task, group_size=len(group), lease_s=1)
        groups.append(build_group(grant, episodes, "bench", 0.0))
    return groups


def tokens(groups: list[protocol.TrajectoryGroup]) -> tuple[int, int]:
    """(tokens forwarded: prompt + completion of every sequence, tokens with loss)."""
    total = masked = 0
    for group in groups:
        for s in group.samples:
            total += (len(s.prompt_ids) + len(s.completion_ids)) // 4
            masked += int(protocol.unpack_mask(s.loss_mask).sum())
    return total, masked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6, help="max model calls per episode")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--step-groups", type=int, default=2, help="groups in the timed train_step (CPU: slow)"
    )
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per forward")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = load_config(None, [])
    path = resolve_model(EMBEDDED_MODEL, config.model.cache_dir)
    engine = TorchEngine(path, seed=args.seed)
    source = TaskSource("react", difficulties=[2, 3])
    rng = random.Random(args.seed)
    tasks = [source.sample(rng) for _ in range(args.tasks)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    async def play_all() -> list[list[Played]]:
        env = AgentEnv("react", ReactAgent(max_turns=args.turns), episode_timeout_s=600)
        try:
            return [g for g in await env.play(engine, tasks, args.group, params) if g]
        finally:
            await env.close()

    start = time.perf_counter()
    played = asyncio.run(play_all())
    play_s = time.perf_counter() - start
    turns = [len(p.calls) for g in played for p in g]
    mean_turns = statistics.mean(turns)
    print(f"played {len(turns)} episodes in {play_s:.0f} s, {mean_turns:.2f} calls", flush=True)

    variants = {"merged": groups_of(played, True), "unmerged": groups_of(played, False)}
    model, _ = load_causal_lm(path)
    swarm = SwarmOptimizer(
        SwarmConfig(run_id=f"bench-merge-{time.monotonic_ns()}"),
        model.parameters(),
        lr=1e-6,
        weight_decay=0.0,
        target_batch_size=1 << 30,  # never step: both variants train the same weights
    )
    # Small micro-batches: unmerged, a batch holds every call's whole context (the default
    # of 16 long sequences at once took 17 GB here and was OOM-killed).
    trainer = TrainerConfig(micro_batch_samples=args.micro_batch)
    learner = Learner(model, swarm, trainer, temperature=1.0, pad_token_id=0)
    step_s: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(args.repeats):
            for name, groups in variants.items():  # interleaved: noise hits both alike
                model.zero_grad(set_to_none=True)
                row = learner.train_step(groups[: args.step_groups]).row()
                step_s[name].append(row["perf/step_s"])
    finally:
        swarm.shutdown()
    result: dict = {"turns": round(statistics.mean(turns), 2)}
    for name, groups in variants.items():
        total, masked = tokens(groups)
        result[name] = {
            "trained_tokens": total,
            "loss_tokens": masked,
            "sequences": sum(len(g.samples) for g in groups),
            "step_s": round(statistics.median(step_s[name]), 2),
            "step_tokens": tokens(groups[: args.step_groups])[0],
        }
    result["token_ratio"] = round(
        result["unmerged"]["trained_tokens"] / result["merged"]["trained_tokens"], 2
    )
    result["step_ratio"] = round(result["unmerged"]["step_s"] / result["merged"]["step_s"], 2)
    result["setup"] = {
        "model": EMBEDDED_MODEL,
        "episodes": len(turns),
        "max_turns": args.turns,
        "max_new_tokens": args.max_new_tokens,
        "step_groups": args.step_groups,
        "torch_threads": 2,
        "mean_reward": round(statistics.mean(p.reward for g in played for p in g), 3),
        "play_s": round(play_s, 1),
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
