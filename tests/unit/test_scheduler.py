"""The scheduler's pure decisions: which tasks to hand out, which leases ran out."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from agentjet.config import EnvConfig
from agentjet.protocol import GroupReport
from agentjet.tasks import generate_tasks, write_task_file
from coordinator.scheduler import (
    SWEEP_EVERY_S,
    Lease,
    Scheduler,
    UniformScheduler,
    draw_rng,
    expired,
    share_out,
    sweep_interval_s,
)

pytestmark = pytest.mark.unit


def test_environments_are_chosen_by_weight() -> None:
    scheduler = UniformScheduler(
        [EnvConfig(name="arithmetic", weight=3.0), EnvConfig(name="python_tool", weight=1.0)],
        seed=0,
    )
    tasks = scheduler.choose(4000, random.Random(0))
    share = Counter(task.env for task in tasks)["arithmetic"] / len(tasks)
    # 3:1 weights -> 0.75; the binomial standard deviation at n=4000 is 0.007.
    assert share == pytest.approx(0.75, abs=0.03)


def test_tasks_of_a_file_are_drawn_uniformly(tmp_path: Path) -> None:
    task_file = tmp_path / "tasks.jsonl"
    write_task_file(generate_tasks(4, seed=1), task_file)
    scheduler = UniformScheduler([EnvConfig(task_file=str(task_file))])
    counts = Counter(task.id for task in scheduler.choose(4000, random.Random(0)))
    assert len(counts) == 4
    assert all(count / 4000 == pytest.approx(0.25, abs=0.03) for count in counts.values())


def test_generated_tasks_follow_the_configured_difficulties_and_ops() -> None:
    scheduler = UniformScheduler([EnvConfig(difficulties=[2], ops=["*"])])
    tasks = scheduler.choose(50, random.Random(3))
    assert {(t.difficulty, t.op, t.env) for t in tasks} == {(2, "*", "arithmetic")}
    assert all(10 <= int(a) <= 99 for t in tasks for a in t.id[3:].split("*"))


def test_choices_are_reproducible_and_continue_after_a_restart() -> None:
    envs = [EnvConfig()]
    first = UniformScheduler(envs).choose(8, draw_rng(seed=7, grants_issued=0))
    again = UniformScheduler(envs).choose(8, draw_rng(seed=7, grants_issued=0))
    resumed = UniformScheduler(envs).choose(8, draw_rng(seed=7, grants_issued=8))
    assert first == again
    assert resumed != first
    assert UniformScheduler(envs, seed=5).choose(4) == UniformScheduler(envs, seed=5).choose(4)
    assert UniformScheduler(envs).choose(0, random.Random(0)) == []


def test_uniform_scheduler_is_a_scheduler_that_ignores_reports() -> None:
    scheduler: Scheduler = UniformScheduler([EnvConfig()])
    task = scheduler.choose(1, random.Random(0))[0]
    scheduler.observe(task, GroupReport(node_id="n", grant_id="g", rewards=[1.0, 0.0]))
    assert scheduler.choose(5, random.Random(1)) == UniformScheduler([EnvConfig()]).choose(
        5, random.Random(1)
    )


def test_leases_expire_when_their_node_is_silent_longer_than_the_lease() -> None:
    leases = [
        Lease("g1", "node-a", last_seen=100.0),
        Lease("g2", "node-a", last_seen=100.0),
        Lease("g3", "node-b", last_seen=105.0),
    ]
    assert expired(leases, now=110.0, lease_s=10.0) == []  # silent exactly the lease: still ok
    assert [lease.grant_id for lease in expired(leases, now=110.5, lease_s=10.0)] == ["g1", "g2"]
    assert len(expired(leases, now=115.5, lease_s=10.0)) == 3


def test_silence_counts_from_the_coordinator_start_at_the_earliest() -> None:
    leases = [Lease("g1", "node-a", last_seen=100.0)]
    # The coordinator was down from 101 to 200: the node could not have reached it.
    assert expired(leases, now=205.0, lease_s=10.0, not_before=200.0) == []
    assert expired(leases, now=210.5, lease_s=10.0, not_before=200.0) == leases


def test_sweeps_run_often_enough_for_short_leases() -> None:
    assert sweep_interval_s(1.0) == 0.25
    assert sweep_interval_s(120.0) == SWEEP_EVERY_S


def test_policies_get_grants_by_their_shares_across_requests_and_regrants() -> None:
    shares = {"a": 1.0, "b": 3.0}
    granted: dict[str, int] = {}
    for count in (1, 3, 5, 7):  # requests of any size
        for policy, k in share_out(count, shares, granted).items():
            granted[policy] = granted.get(policy, 0) + k
    assert granted == {"a": 4, "b": 12}
    # A policy behind its share (its grants went elsewhere, e.g. regrants) catches up first.
    assert share_out(4, shares, {"a": 0, "b": 12}) == {"a": 4}
    assert share_out(3, {"": 1.0}, {}) == {"": 3}
