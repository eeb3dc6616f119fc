"""Logprob-gap benchmark: how far honest sampler logprobs are from the learner's, by policy
lag, and how far forged ones are (the numbers behind `trainer.max_logprob_gap`).

    TorchEngine (weights of version k) ──arithmetic groups──▶ held back l versions (l = 0..lag)
        ──▶ Learner.train_step at version k + l ──▶ each group's gap (rl.logprob_gap: the
            largest over its samples of the mean |log pi_theta - log mu| per trained token)
    then, at the last version: fresh groups forged four ways ──▶ their gaps

Every step trains --per-lag groups of each lag 0..--lag at once, as a trainer whose queue
holds groups of several ages does. The policy moves by the trainer's own learning rate
(AdamW's first steps move every weight by about lr, whatever the rewards), so rewards are
set to 1, 0, 1, 0, ... within each group: every sample then carries gradient and is
checked (the learner checks only samples it trains). The engine samples at the config's
temperature; --engine-dtype bfloat16 stands in for an engine whose kernels differ from
the learner's (vLLM on a GPU), the learner staying in float32.

Run: `just bench-logprob-gap` (SmolLM2-135M) or `... --model tiny` (the test model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from agentjet import protocol  # noqa: E402
from agentjet.config import EMBEDDED_MODEL, SwarmConfig, load_config  # noqa: E402
from agentjet.episode import SamplingParams  # noqa: E402
from agentjet.tasks import generate_tasks  # noqa: E402
from node.learner import Learner  # noqa: E402
from node.model import build_tiny_model, load_causal_lm, resolve_model  # noqa: E402
from node.rollout import build_group  # noqa: E402
from node.swarm import SwarmOptimizer  # noqa: E402
from node.torch_engine import TorchEngine  # noqa: E402
from sandboxes.envs.arithmetic import ArithmeticEnv  # noqa: E402
from tests.factories import forge  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "logprob_gap.json"


def sample_groups(
    engine: TorchEngine, version: int, count: int, n: int, params: SamplingParams, tag: str
) -> list[protocol.TrajectoryGroup]:
    tasks = generate_tasks(count, seed=1000 + version, difficulties=[1, 2], env="arithmetic")
    played = asyncio.run(ArithmeticEnv().run_group(engine, tasks, n, params))
    groups = []
    for i, (task, episodes) in enumerate(zip(tasks, played, strict=True)):
        for j, episode in enumerate(episodes):
            episode.reward = float(j % 2 == 0)
        grant = protocol.WorkGrant(
            grant_id=f"{tag}-v{version}-{i}", task=task, group_size=n, lease_s=60.0
        )
        groups.append(build_group(grant, episodes, "bench", 0.0))
    return groups


def altered(ids: np.ndarray, where: list[int], vocab: int) -> np.ndarray:
    ids[where] = (ids[where] + 1000) % vocab
    return ids


def summary(values: list[float]) -> dict[str, float]:
    return {
        "groups": len(values),
        "median": statistics.median(values),
        "max": max(values),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_MODEL, help='"tiny" for the test model')
    parser.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lag", type=int, default=4, help="largest policy lag measured")
    parser.add_argument("--per-lag", type=int, default=1, help="groups of each lag per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], help="config override a.b=v")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    config = load_config(None, args.set)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.model == "tiny":
        path = build_tiny_model(Path(tempfile.mkdtemp(prefix="aj-tiny-")), seed=0)
    else:
        path = resolve_model(args.model, config.model.cache_dir)
    sampling = config.rollout.sampling
    params = SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens,
    )
    engine = TorchEngine(path, dtype=args.engine_dtype, seed=1)
    model, _ = load_causal_lm(path)
    swarm = SwarmOptimizer(
        SwarmConfig(run_id=f"bench-gap-{time.monotonic_ns()}"),
        model.parameters(),
        lr=config.trainer.lr,
        weight_decay=config.trainer.weight_decay,
        target_batch_size=1,
    )
    # The bound off: every group is trained and its gap reported.
    trainer = msgspec.structs.replace(config.trainer, max_logprob_gap=0.0)
    learner = Learner(model, swarm, trainer, params.temperature, 0)
    by_lag: dict[int, list[float]] = {lag: [] for lag in range(args.lag + 1)}
    due: dict[int, list[tuple[int, protocol.TrajectoryGroup]]] = {}
    start = time.perf_counter()
    try:
        for version in range(2 * args.lag + 1):
            weights = {k: v.detach().clone() for k, v in model.named_parameters()}
            asyncio.run(engine.load_state_dict(weights, version))
            for lag in range(args.lag + 1):
                if version + lag <= 2 * args.lag:
                    fresh = sample_groups(
                        engine, version, args.per_lag, args.group_size, params, f"lag{lag}"
                    )
                    due.setdefault(version + lag, []).extend((lag, g) for g in fresh)
            batch = due.pop(version)
            row = learner.train_step([g for _, g in batch]).row()
            assert row["policy_version"] == version + 1, row["policy_version"]
            for lag, group in batch:
                by_lag[lag].append(row["logprob_gaps"][group.group_id])
            print(
                f"version {version}: "
                + ", ".join(f"lag {lag} {row['logprob_gaps'][g.group_id]:.5f}" for lag, g in batch),
                flush=True,
            )
        version = 2 * args.lag + 1
        weights = {k: v.detach().clone() for k, v in model.named_parameters()}
        asyncio.run(engine.load_state_dict(weights, 0))
        honest = sample_groups(engine, version, 2, args.group_size, params, "forge")
        vocab = int(model.config.vocab_size)
        kinds = {
            "logprobs_zero": {"logprobs": lambda lp: lp * 0},
            "logprobs_halved": {"logprobs": lambda lp: lp / 2},
            "one_token_altered": {"tokens": lambda ids: altered(ids, [len(ids) // 2], vocab)},
            "all_tokens_altered": {"tokens": lambda ids: (ids + 1000) % vocab},
        }
        batch = [
            *honest,
            *(forge(g, f"{g.group_id}-{how}", **kw) for how, kw in kinds.items() for g in honest),
        ]
        gaps = learner.train_step(batch).logprob_gaps
    finally:
        swarm.shutdown()
    result = {
        "model": args.model,
        "engine_dtype": args.engine_dtype,
        "lr": config.trainer.lr,
        "temperature": params.temperature,
        "group_size": args.group_size,
        "honest_by_lag": {lag: summary(v) for lag, v in by_lag.items()},
        "honest_fresh": [gaps[g.group_id] for g in honest],
        "forged": {how: [gaps[f"{g.group_id}-{how}"] for g in honest] for how in kinds},
        "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
