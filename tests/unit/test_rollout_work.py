"""A rollout node's link to the coordinator (node/rollout_work.py), built alone: while no
coordinator answers, work is drawn locally from the node's own task sources, for a policy
with room, and the coordinator hears nothing of it."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from typing import Any, cast

import msgspec
import pytest

from agentjet import protocol
from agentjet.config import Config, config_from_dict
from agentjet.episode import Episode
from node.delivery import Ledger
from node.engine import Engine
from node.rollout_delivery import Backpressure
from node.rollout_peers import Peers
from node.rollout_work import FALLBACK_PROBE_S, LOCAL_GRANT_PREFIX, Work
from tests.factories import make_group

pytestmark = pytest.mark.unit


class FakeEngine:
    policy_version = 7


def two_policies(max_unacked_groups: int = 2) -> Config:
    """A solver training arithmetic, a coder training python_code (and weighted 2)."""
    data: dict[str, Any] = {
        "envs": [{"name": "arithmetic"}, {"name": "python_code"}],
        "rollout": {"groups_per_batch": 12, "max_unacked_groups": max_unacked_groups},
        "policies": [
            {"name": "solver", "envs": ["arithmetic"]},
            {"name": "coder", "weight": 2.0},
        ],
    }
    return config_from_dict(data)


def work_of(config: Config, ledger: Ledger) -> Work:
    hello = protocol.Hello(node_id="rollout-test", role="rollout")
    peers = Peers(config, hello, None, {})  # (no coordinator listed)
    names = [p.name for p in config.policies]
    backpressure = Backpressure(ledger, names, config.rollout.max_unacked_groups)
    engine = cast(Engine, FakeEngine())
    counts: defaultdict[str, int] = defaultdict(int)
    return Work("rollout-test", config, engine, peers, backpressure, counts)


def held_back(ledger: Ledger, policy: str, count: int) -> None:
    """`count` groups of `policy` that no trainer has accepted yet."""
    for i in range(count):
        group = make_group(f"{policy}-{i}")
        group.policy = policy
        ledger.add(group)


def test_local_grants_draw_from_the_sources_for_a_policy_with_room() -> None:
    config = two_policies()
    ledger = Ledger(rng=random.Random(0))
    work = work_of(config, ledger)
    held_back(ledger, "solver", 2)  # the solver is at its bound

    grants = work.local_grants()
    assert len(grants) == 12 and work.counts["local_grants"] == 12
    assert {g.task.env for g in grants} <= {"arithmetic", "python_code"}
    for grant in grants:
        assert grant.grant_id.startswith(LOCAL_GRANT_PREFIX)
        assert grant.group_size == config.rollout.group_size
        # the coder trains every env; the solver, arithmetic only, has no room
        assert grant.policy == "coder"

    ledger.pending.clear()  # room for both again
    policies = {work.local_policy("arithmetic", ["solver", "coder"]) for _ in range(200)}
    assert policies == {"solver", "coder"}
    assert work.local_policy("python_code", ["solver", "coder"]) == "coder"
    assert work.local_policy("python_code", ["solver"]) == ""  # no room for its trainer


def test_without_a_coordinator_work_is_local_and_reports_of_it_stay_home() -> None:
    work = work_of(two_policies(), Ledger(rng=random.Random(0)))
    assert work.coordinator_timeout() is None

    grants = asyncio.run(work.request())
    assert grants and all(g.grant_id.startswith(LOCAL_GRANT_PREFIX) for g in grants)
    assert work.coordinator_away and work.coordinator_timeout() == FALLBACK_PROBE_S

    work.queue_report(grants[0], [Episode(prompt_ids=[1], reward=1.0)], 1.0, "")
    assert work.reports.empty()  # the coordinator has no grant to attach it to
    granted = msgspec.structs.replace(grants[0], grant_id="g-1")
    work.queue_report(granted, [Episode(prompt_ids=[1], reward=1.0, error="tool")], 2.0, "")
    report = work.reports.get_nowait()
    assert (report.grant_id, report.rewards, report.failed, report.error) == (
        "g-1",
        [1.0],
        False,
        "tool",
    )
