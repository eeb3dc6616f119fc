"""The produce loop's stages (node/rollout_produce.py), alone: a grant's episodes become one
group per policy their agents called; a batch of grants is played, its groups held, its
grants reported, one metrics row written. Fake engine and environment, hand-made episodes."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from agentjet import protocol
from agentjet.config import Config
from agentjet.episode import Episode, Generator, SamplingParams
from agentjet.errors import EngineError
from agentjet.metrics import MetricsWriter, read_metrics
from agentjet.timeline import Sequence
from node.delivery import Ledger
from node.engine import Engine
from node.gpu_monitor import GpuMonitor
from node.policy_sync import PolicySync
from node.rollout_delivery import Backpressure
from node.rollout_peers import Peers
from node.rollout_produce import (
    Producer,
    batches_by_env,
    build_groups,
    model_tokens,
    played_groups,
)
from node.rollout_work import Work
from node.teacher import LocalTeachers
from node.trajectory_log import TrajectoryLog
from sandboxes.envs import Environment

pytestmark = pytest.mark.unit


def grant(
    grant_id: str, env: str = "arithmetic", policy: str = "", n: int = 2
) -> protocol.WorkGrant:
    task = protocol.Task(id=f"task-{grant_id}", env=env, prompt="1 + 1")
    return protocol.WorkGrant(
        grant_id=grant_id, task=task, group_size=n, lease_s=60.0, policy=policy
    )


def sequence(policy: str, tokens: int, version: int) -> Sequence:
    return Sequence(
        prompt_ids=[1, 2],
        completion_ids=list(range(tokens)),
        logprobs=[-0.5] * tokens,
        loss_mask=[1] * tokens,
        policy_version=version,
        policy=policy,
    )


def test_an_episode_calling_two_policies_makes_a_group_for_each() -> None:
    episodes = [
        Episode(
            prompt_ids=[1],
            reward=1.0,
            sequences=[sequence("planner", 2, 3), sequence("solver", 3, 5)],
            policy_rewards={"planner": 0.5},
        ),
        Episode(prompt_ids=[1], reward=0.0, sequences=[sequence("solver", 4, 5)]),
    ]
    groups = build_groups(grant("g", policy="solver"), episodes, "node", 2.0, {"solver": "ls"})
    assert [(g.group_id, g.grant_id, g.policy, g.lineage) for g in groups] == [
        ("g", "g", "solver", "ls"),
        ("g-planner", "g", "planner", ""),
    ]
    solver, planner = groups
    assert [s.reward for s in solver.samples] == [1.0, 0.0]
    assert [s.policy_version for s in solver.samples] == [5, 5]
    # The planner took part in one episode of two: its own reward, half the wall time.
    assert [s.reward for s in planner.samples] == [0.5] and planner.wall_s == 1.0
    assert [model_tokens(e) for e in episodes] == [5, 4]


def test_an_episode_of_one_policy_makes_one_group_with_the_grants_id() -> None:
    episodes = [Episode(prompt_ids=[1], reward=r) for r in (1.0, 0.0)]
    [group] = build_groups(grant("g"), episodes, "node", 2.0, {"": "root"})
    assert (group.group_id, group.policy, group.lineage, group.wall_s) == ("g", "", "root", 2.0)
    assert [s.advantage > 0 for s in group.samples] == [True, False]


def test_grants_are_played_per_environment_and_policy_and_unfinished_ones_build_nothing() -> None:
    grants = [grant("a"), grant("b", env="shell"), grant("c"), grant("d", policy="coder")]
    batches = batches_by_env(grants)
    assert {key: [g.grant_id for g in gs] for key, gs in batches.items()} == {
        ("arithmetic", 2, ""): ["a", "c"],
        ("shell", 2, ""): ["b"],
        ("arithmetic", 2, "coder"): ["d"],
    }
    episodes = [[Episode(prompt_ids=[1], reward=1.0)], []]
    played = played_groups([grant("a"), grant("c")], episodes, "node", 1.0, {})
    assert [(g.grant_id, group.group_id) for g, _, group in played] == [("a", "a")]


class FakeEngine:
    policy_version = 4
    failure: Exception | None = None
    policy_versions: dict[str, int] = {}
    tokenizer = None
    device = torch.device("cpu")


class FakeSync:
    lineage = protocol.Lineage()

    async def load(self) -> None:
        pass


class NoTeachers:
    envs: set[str] = set()
    held = 0


class FakeEnv:
    """Two episodes of each task but the one named `task-unfinished` (none)."""

    def __init__(self) -> None:
        self.played: list[list[str]] = []

    async def run_group(
        self, generator: Generator, tasks: list[protocol.Task], n: int, params: SamplingParams
    ) -> list[list[Episode]]:
        self.played.append([t.id for t in tasks])
        return [[] if t.id == "task-unfinished" else two_episodes() for t in tasks]


def two_episodes() -> list[Episode]:
    """Rewards 1 and 0, two sampled tokens each."""
    return [
        Episode(prompt_ids=[1], completion_ids=[2, 3], loss_mask=[1, 1], reward=r)
        for r in (1.0, 0.0)
    ]


def producer_of(tmp_path: Path, ledger: Ledger) -> tuple[Producer, Work, MetricsWriter, FakeEnv]:
    config = Config()
    engine = cast(Engine, FakeEngine())
    counts: defaultdict[str, int] = defaultdict(int)
    backpressure = Backpressure(ledger, [""], config.rollout.max_unacked_groups)
    hello = protocol.Hello(node_id="rollout-test", role="rollout")
    work = Work(
        "rollout-test", config, engine, Peers(config, hello, None, {}), backpressure, counts
    )
    metrics = MetricsWriter(tmp_path, "rollout")
    env = FakeEnv()
    producer = Producer(
        node_id="rollout-test",
        config=config,
        engine=engine,
        policies=cast(Mapping[str, PolicySync], {"": FakeSync()}),
        envs=cast(Mapping[str, Environment], {"arithmetic": env}),
        held_out={},
        work=work,
        backpressure=backpressure,
        ledger=ledger,
        unsent=asyncio.Event(),
        teachers=cast(LocalTeachers, NoTeachers()),
        trajectories=TrajectoryLog(tmp_path, 0.0, 1 << 20, 0),
        metrics=metrics,
        gpu=GpuMonitor.for_devices(["cpu"]),
        pool=None,
        counts=counts,
    )
    return producer, work, metrics, env


def test_a_batch_is_held_reported_and_written_as_one_row(tmp_path: Path) -> None:
    ledger = Ledger(rng=random.Random(0))
    producer, work, metrics, env = producer_of(tmp_path, ledger)
    grants = [grant("g1"), grant("unfinished"), grant("g2")]

    asyncio.run(producer.play("arithmetic", 2, "", grants))
    metrics.close()

    assert env.played == [["task-g1", "task-unfinished", "task-g2"]]
    assert list(ledger.pending) == ["g1", "g2"] and producer.unsent.is_set()
    reports = [work.reports.get_nowait() for _ in range(work.reports.qsize())]
    assert [(r.grant_id, r.failed, r.error) for r in reports] == [
        ("unfinished", True, "no episodes"),
        ("g1", False, ""),
        ("g2", False, ""),
    ]
    [row] = read_metrics(tmp_path / "metrics" / "rollout.jsonl")
    assert row["event"] == "batch" and row["group_ids"] == ["g1", "g2"]
    assert row["policy_version"] == 4 and row["unacked"] == 2
    assert row["charts/reward_mean"] == 0.5 and "policy" not in row
    assert (row["groups_created"], row["groups_failed"]) == (2, 1)
    assert producer.samples_per_s > 0


def test_a_batch_for_an_environment_this_node_lacks_is_reported_failed(tmp_path: Path) -> None:
    producer, work, metrics, env = producer_of(tmp_path, Ledger(rng=random.Random(0)))
    asyncio.run(producer.play("shell", 2, "", [grant("g", env="shell")]))
    metrics.close()
    report: Any = work.reports.get_nowait()
    assert (report.failed, report.error) == (True, "no environment 'shell' here")
    assert env.played == [] and read_metrics(tmp_path / "metrics" / "rollout.jsonl") == []


def test_an_engine_that_failed_under_an_agents_call_stops_the_node_after_the_batch(
    tmp_path: Path,
) -> None:
    """An agent met the engine's death through the OpenAI endpoint (a 503): its episode
    ended without a group, and the environment returned as usual. The batch then raises the
    engine's EngineError (`run` counts it as an engine fault) and holds nothing it played."""
    ledger = Ledger(rng=random.Random(0))
    producer, work, metrics, env = producer_of(tmp_path, ledger)
    producer.engine.failure = EngineError("vLLM's engine core died")
    with pytest.raises(EngineError, match="engine core died"):
        asyncio.run(producer.play("arithmetic", 2, "", [grant("g1")]))
    metrics.close()
    assert env.played == [["task-g1"]] and list(ledger.pending) == []
