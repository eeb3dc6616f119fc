"""What to hand out next, and which leases have run out: pure decisions, no I/O.

    config.envs ──▶ make_scheduler(config) ──▶ UniformScheduler | EnvSched (coordinator/envsched.py)
    Scheduler.choose(k, rng, open_by_env, grants_issued) ──▶ [Task, …]
    share_out(k, policy shares, grants per policy) ──▶ how many of k each policy gets
    GroupReport ──▶ Scheduler.observe(task, report) ──▶ Scheduler.statistics (both keep them)
    [Lease] + now ──▶ expired(…) ──▶ leases whose node went silent

The coordinator draws every batch from `draw_rng(seed, grants_issued)`, so the choice depends
only on the durable history: a restarted coordinator continues the sequence instead of
repeating it from the start (EnvSched's statistics are rebuilt by replaying the stored reports).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

from agentjet.config import Config, EnvConfig, EnvSchedConfig, RolloutConfig
from agentjet.protocol import GroupReport, Task
from agentjet.tasks import TaskSource, draw_tasks
from coordinator.envsched import EnvSched, Statistics


class Scheduler(Protocol):
    """A policy that picks tasks and may learn from what the rollout nodes report."""

    # Reward statistics of everything reported so far (shown by `agentjet status`).
    statistics: Statistics

    def choose(
        self,
        k: int,
        rng: random.Random | None = None,
        open_by_env: Mapping[str, int] | None = None,
        grants_issued: int = 0,
    ) -> list[Task]:
        """Up to `k` tasks to grant next (repeats allowed), given the open grants per
        environment and how many grants were issued before."""
        ...

    def observe(self, task: Task, report: GroupReport) -> None:
        """Learn from the outcome of one granted task (called once per accepted report)."""
        ...

    def target_weights(self, grants_issued: int) -> dict[str, float]:
        """The ratio target of each environment (by name) at this point of the run."""
        ...


class UniformScheduler:
    """The baseline: an environment by its configured weight, then a task uniformly from it.

    It keeps the same statistics as EnvSched, to show them, but never looks at them.
    """

    def __init__(
        self, envs: Sequence[EnvConfig], seed: int = 0, statistics: Statistics | None = None
    ) -> None:
        if not envs:
            raise ValueError("UniformScheduler needs at least one environment")
        self.sources = [TaskSource.from_config(env) for env in envs]
        self.weights = [env.weight for env in envs]
        self.statistics = statistics or Statistics(EnvSchedConfig(), RolloutConfig().group_size)
        # Used only when the caller passes no rng (e.g. a node's local fallback).
        self.rng = random.Random(seed)

    def choose(
        self,
        k: int,
        rng: random.Random | None = None,
        open_by_env: Mapping[str, int] | None = None,
        grants_issued: int = 0,
    ) -> list[Task]:
        """`k` tasks; capacity limits and ratio schedules are EnvSched's, not the baseline's."""
        return draw_tasks(rng or self.rng, self.sources, self.weights, k)

    def observe(self, task: Task, report: GroupReport) -> None:
        """Uniform sampling does not learn; it only measures."""
        self.statistics.observe(task, report)

    def target_weights(self, grants_issued: int) -> dict[str, float]:
        weights: dict[str, float] = {}
        for source, weight in zip(self.sources, self.weights, strict=True):
            weights[source.env] = weights.get(source.env, 0.0) + weight
        return weights


def make_scheduler(config: Config) -> Scheduler:
    """The scheduler `coordinator.scheduler` names, seeded by the run."""
    params, group_size = config.coordinator.envsched, config.rollout.group_size
    if config.coordinator.scheduler == "envsched":
        return EnvSched(config.envs, params, group_size, config.run.seed)
    return UniformScheduler(config.envs, config.run.seed, Statistics(params, group_size))


def share_out(count: int, shares: dict[str, float], granted: dict[str, int]) -> dict[str, int]:
    """How many of `count` new grants go to each policy: one at a time to the policy furthest
    below its share of all grants so far (`granted`, per policy), so shares hold across
    requests, restarts (the counts are the store's) and regrants."""
    total_share = sum(shares.values())
    counts = {policy: granted.get(policy, 0) for policy in shares}
    total = sum(counts.values())
    split = dict.fromkeys(shares, 0)
    for _ in range(count):
        total += 1
        policy = max(shares, key=lambda p: total * shares[p] / total_share - counts[p])
        counts[policy] += 1
        split[policy] += 1
    return {policy: k for policy, k in split.items() if k}


def draw_rng(seed: int, grants_issued: int) -> random.Random:
    """The rng for the next batch: a function of the run seed and how much was issued before.

    String seeds hash with SHA-512, so the stream is stable across processes and Python runs.
    """
    return random.Random(f"{seed}/{grants_issued}")


class Lease(NamedTuple):
    """An open grant as the lease logic sees it: which node holds it, when it was last heard."""

    grant_id: str
    node_id: str
    last_seen: float  # unix seconds


def expired(
    leases: Iterable[Lease], now: float, lease_s: float, not_before: float = -math.inf
) -> list[Lease]:
    """The leases whose node has been silent for longer than `lease_s` at `now`.

    Silence counts from `not_before` at the earliest: pass the coordinator's start time so that
    nodes are not blamed for the time the coordinator itself was down.
    """
    return [lease for lease in leases if now - max(lease.last_seen, not_before) > lease_s]


# A silent node's lease is noticed at most this long after it runs out (bounds re-grant delay).
SWEEP_EVERY_S = 2.0


def sweep_interval_s(lease_s: float) -> float:
    """How often to look for expired leases: every SWEEP_EVERY_S, or four times per lease."""
    return min(SWEEP_EVERY_S, lease_s / 4)
