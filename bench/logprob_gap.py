"""Logprob-gap benchmark: how far honest sampler logprobs are from the learner's, by policy
lag, and how far forged ones are (the numbers behind `trainer.max_logprob_gap`).

    TorchEngine (weights of version k) ──arithmetic groups──▶ held back l versions (l = 0..lag)
        ──▶ Learner.train_step at version k + l ──▶ each group's gap (rl.logprob_gap: |mean
            log pi_theta - log mu| over its checked samples' trained tokens)
    then, at the last version: fresh groups forged four ways ──▶ their gaps

Every step trains --per-lag groups of each lag 0..--lag at once, as a trainer whose queue
holds groups of several ages does. The policy moves by the trainer's own learning rate
(AdamW's first steps move every weight by about lr, whatever the rewards), so rewards are
set to 1, 0, 1, 0, ... within each group: every sample then carries gradient and is
checked (the learner checks only samples it trains). The engine samples at the config's
temperature; --engine-dtype bfloat16 stands in for an engine whose kernels differ from
the learner's (vLLM on a GPU), the learner staying in float32.

--task truefalse plays short-answer tasks instead ("Is 17 greater than 23?", answered True
or False; --max-new-tokens 4 by default: 1-4 token answers, where one token weighs most),
rewarded by the answer's first word. Besides the check's own statistic, every checked
sample's per-token log pi_theta - log mu is captured and candidate statistics computed from
them (`candidates`): the max over samples of the mean |difference| (the check before
2026-12-06), the group's pooled mean |difference|, its pooled signed mean (|mean
difference|), the same with each sample counted as rl.GAP_MIN_SAMPLE_TOKENS tokens at
least (the check now: rl.logprob_gap) and |1 - mean ratio|.

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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from agentjet import protocol, rl  # noqa: E402
from agentjet.config import EMBEDDED_MODEL, SwarmConfig, load_config  # noqa: E402
from agentjet.episode import Episode, SamplingParams  # noqa: E402
from agentjet.tasks import generate_tasks  # noqa: E402
from node.learner import Learner  # noqa: E402
from node.model import build_tiny_model, load_causal_lm, resolve_model  # noqa: E402
from node.rollout_produce import build_group  # noqa: E402
from node.swarm import SwarmOptimizer  # noqa: E402
from node.torch_engine import TorchEngine  # noqa: E402
from sandboxes.envs.arithmetic import ArithmeticEnv  # noqa: E402
from sandboxes.envs.chat import single_turn_episodes  # noqa: E402
from tests.factories import forge  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "logprob_gap.json"


TRUE_FALSE_SYSTEM = "Answer with exactly one word: True or False."


def true_false_tasks(count: int, seed: int) -> list[protocol.Task]:
    """Short-answer tasks, reasoning-gym style: a claim about two numbers, True or False."""
    rng = np.random.default_rng(seed)
    tasks = []
    for i in range(count):
        a, b = (int(x) for x in rng.integers(1, 100, size=2))
        kind = i % 3
        if kind == 0:
            claim, truth = f"Is {a} greater than {b}?", a > b
        elif kind == 1:
            claim, truth = f"True or False: {a} is an even number.", a % 2 == 0
        else:
            claim, truth = f"True or False: {a} + {b} = {a + b + (i % 2)}.", i % 2 == 0
        tasks.append(
            protocol.Task(id=f"tf{seed}-{i}", env="prompt", prompt=claim, answer=str(truth))
        )
    return tasks


def play(
    engine: TorchEngine, task_kind: str, version: int, count: int, n: int, params: SamplingParams
) -> tuple[list[protocol.Task], list[list[Episode]]]:
    """`count` tasks of `task_kind`, each played `n` times. Arithmetic groups are rewarded 1, 0,
    1, 0 (every sample then carries gradient and is checked); true/false ones by their answers
    (the gradients of a real run, all pushing the answer token; groups whose rewards agree are
    not trained, so not checked)."""
    if task_kind == "arithmetic":
        tasks = generate_tasks(count, seed=1000 + version, difficulties=[1, 2], env="arithmetic")
        played = asyncio.run(ArithmeticEnv().run_group(engine, tasks, n, params))
    else:
        tasks = true_false_tasks(count, seed=1000 * version + count)
        played = asyncio.run(single_turn_episodes(engine, TRUE_FALSE_SYSTEM, tasks, n, params))
        for task, episodes in zip(tasks, played, strict=True):
            for episode in episodes:
                text = str(
                    engine.tokenizer.decode(episode.completion_ids, skip_special_tokens=True)
                )
                words = text.replace(".", " ").split()
                episode.reward = float(bool(words) and words[0] == task.answer)
    if task_kind == "arithmetic":
        for episodes in played:
            for j, episode in enumerate(episodes):
                episode.reward = float(j % 2 == 0)
    return tasks, played


class TokenDiffs:
    """Wraps `rl.logprob_differences` (the learner's check) to keep each checked sample's
    per-token log pi_theta - log mu, in the order the learner forwards them."""

    def __init__(self) -> None:
        self.rows: list[list[float]] = []
        self.wrapped = rl.logprob_differences

    def __call__(
        self, logprobs: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        for lp, mu, m in zip(logprobs, sampler, mask.bool(), strict=True):
            self.rows.append((lp - mu)[m].double().tolist())
        return self.wrapped(logprobs, sampler, mask)

    def by_group(self, groups: list[protocol.TrajectoryGroup]) -> dict[str, list[list[float]]]:
        """The captured rows of the last train_step over `groups` (the learner's row order:
        samples with non-zero advantage and a trained token), then forgotten."""
        out: dict[str, list[list[float]]] = {}
        rows = iter(self.rows)
        for group in groups:
            advantages = rl.sample_advantages(
                [s.reward for s in group.samples], [s.episode for s in group.samples]
            )
            for sample, advantage in zip(group.samples, advantages, strict=True):
                if advantage != 0 and protocol.unpack_mask(sample.loss_mask).any():
                    out.setdefault(group.group_id, []).append(next(rows))
        assert next(rows, None) is None, "rows left over: the learner's row order changed"
        self.rows = []
        return out


def candidates(samples: list[list[float]]) -> dict[str, float]:
    """The candidate statistics of one group, from its samples' per-token differences."""
    pooled = np.array([d for sample in samples for d in sample])
    return {
        "max_sample_mean_abs": max(float(np.abs(s).mean()) for s in samples),
        "pooled_mean_abs": float(np.abs(pooled).mean()),
        "pooled_signed": float(abs(pooled.mean())),
        "pooled_signed_floor": rl.logprob_gap([sum(s) for s in samples], [len(s) for s in samples]),
        "pooled_ratio": float(abs(1 - np.exp(pooled).mean())),
        "tokens_per_sample": len(pooled) / len(samples),
    }


def sample_groups(
    engine: TorchEngine,
    version: int,
    count: int,
    n: int,
    params: SamplingParams,
    tag: str,
    task_kind: str = "arithmetic",
) -> list[protocol.TrajectoryGroup]:
    tasks, played = play(engine, task_kind, version, count, n, params)
    groups = []
    for i, (task, episodes) in enumerate(zip(tasks, played, strict=True)):
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


def by_lag_summary(values: dict[int, list[dict[str, float]]]) -> dict[str, Any]:
    """Per lag, each candidate statistic's median and max over groups."""
    return {
        str(lag): {name: summary([c[name] for c in rows]) for name in rows[0]}
        for lag, rows in values.items()
        if rows
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_MODEL, help='"tiny" for the test model')
    parser.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--task", default="arithmetic", choices=["arithmetic", "truefalse"])
    parser.add_argument("--max-new-tokens", type=int, default=0, help="0: the config's (4 "
                        "with --task truefalse)")  # fmt: skip
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
    max_new_tokens = args.max_new_tokens or (
        4 if args.task == "truefalse" else sampling.max_new_tokens
    )
    params = SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, max_new_tokens=max_new_tokens
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
    diffs = TokenDiffs()
    rl.logprob_differences = diffs  # type: ignore[assignment]
    by_lag: dict[int, list[float]] = {lag: [] for lag in range(args.lag + 1)}
    candidates_by_lag: dict[int, list[dict[str, float]]] = {lag: [] for lag in by_lag}
    due: dict[int, list[tuple[int, protocol.TrajectoryGroup]]] = {}
    start = time.perf_counter()
    try:
        for version in range(2 * args.lag + 1):
            weights = {k: v.detach().clone() for k, v in model.named_parameters()}
            asyncio.run(engine.load_state_dict(weights, version))
            for lag in range(args.lag + 1):
                if version + lag <= 2 * args.lag:
                    fresh = sample_groups(
                        engine, version, args.per_lag, args.group_size, params, f"lag{lag}",
                        args.task,
                    )  # fmt: skip
                    due.setdefault(version + lag, []).extend((lag, g) for g in fresh)
            batch = due.pop(version)
            row = learner.train_step([g for _, g in batch]).row()
            tokens = diffs.by_group([g for _, g in batch])
            assert row["policy_version"] == version + 1, row["policy_version"]
            batch = [(lag, g) for lag, g in batch if g.group_id in tokens]  # checked ones
            for lag, group in batch:
                by_lag[lag].append(row["logprob_gaps"][group.group_id])
                candidates_by_lag[lag].append(candidates(tokens[group.group_id]))
            print(
                f"version {version}: "
                + ", ".join(
                    f"lag {lag} "
                    + " ".join(f"{v:.3f}" for v in candidates(tokens[g.group_id]).values())
                    for lag, g in batch
                ),
                flush=True,
            )
        version = 2 * args.lag + 1
        weights = {k: v.detach().clone() for k, v in model.named_parameters()}
        asyncio.run(engine.load_state_dict(weights, 0))
        honest = [
            g
            for g in sample_groups(engine, version, 4, args.group_size, params, "forge", args.task)
            if not rl.zero_variance([s.reward for s in g.samples])
        ][:2]
        vocab = int(model.config.vocab_size)
        kinds = {
            "logprobs_zero": {"logprobs": lambda lp: lp * 0},
            "logprobs_halved": {"logprobs": lambda lp: lp / 2},
            "one_token_altered": {"tokens": lambda ids: altered(ids, [len(ids) // 2], vocab)},
            "all_tokens_altered": {"tokens": lambda ids: (ids + 1000) % vocab},
        }
        forged_batch = [
            *honest,
            *(forge(g, f"{g.group_id}-{how}", **kw) for how, kw in kinds.items() for g in honest),
        ]
        gaps = learner.train_step(forged_batch).logprob_gaps
        tokens = diffs.by_group(forged_batch)
    finally:
        swarm.shutdown()
    result = {
        "model": args.model,
        "engine_dtype": args.engine_dtype,
        "task": args.task,
        "max_new_tokens": max_new_tokens,
        "lr": config.trainer.lr,
        "temperature": params.temperature,
        "group_size": args.group_size,
        "honest_by_lag": {lag: summary(v) for lag, v in by_lag.items() if v},
        "honest_fresh": [gaps[g.group_id] for g in honest],
        "forged": {how: [gaps[f"{g.group_id}-{how}"] for g in honest] for how in kinds},
        "candidates": {
            "honest_by_lag": by_lag_summary(candidates_by_lag),
            "forged": {
                how: [candidates(tokens[f"{g.group_id}-{how}"]) for g in honest] for how in kinds
            },
        },
        "wall_s": time.perf_counter() - start,
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
