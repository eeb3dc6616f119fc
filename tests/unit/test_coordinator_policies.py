"""The coordinator with [[policies]] (issue 26): grants go to the policies by their weights,
each with a task of one of its own environments, and each report teaches the scheduler of
its grant's policy only. The real Coordinator's request handling and its SQLite history."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from agentjet.config import config_from_dict
from agentjet.protocol import Error, GroupReport, Ok, WorkGrants, WorkRequest
from coordinator.service import Coordinator
from coordinator.store import Store

pytestmark = pytest.mark.unit


def test_grants_follow_the_policies_weights_and_reports_their_own_scheduler(
    tmp_path: Path,
) -> None:
    config = config_from_dict(
        {
            "envs": [{"name": "arithmetic"}, {"name": "python_code"}],
            "policies": [
                {"name": "solver", "envs": ["arithmetic"], "weight": 1.0},
                {"name": "coder", "envs": ["python_code"], "weight": 3.0},
            ],
            "run": {"dir": str(tmp_path)},
        }
    )
    coordinator = Coordinator(config)
    coordinator.store = Store(tmp_path / "coordinator.sqlite", lease_s=60.0)
    try:
        grants = []
        for now, k in enumerate((1, 5, 2, 8)):  # requests of any size
            reply = coordinator.handle(WorkRequest(node_id="r", max_groups=k), float(now))
            assert isinstance(reply, WorkGrants)
            grants += reply.grants
        assert Counter(g.policy for g in grants) == {"solver": 4, "coder": 12}
        assert {g.policy: g.task.env for g in grants} == {
            "solver": "arithmetic",
            "coder": "python_code",
        }
        solver = next(g for g in grants if g.policy == "solver")
        report = GroupReport(node_id="r", grant_id=solver.grant_id, rewards=[1.0, 0.0])
        assert isinstance(coordinator.handle(report, 10.0), Ok)
        assert coordinator.schedulers["solver"].statistics.tick == 1
        assert coordinator.schedulers["coder"].statistics.tick == 0
    finally:
        coordinator.store.close()
    # A restarted coordinator rebuilds each policy's statistics from the history.
    again = Coordinator(config)
    again.store = Store(tmp_path / "coordinator.sqlite", lease_s=60.0)
    try:
        again._replay_reports()
        assert [again.schedulers[p].statistics.tick for p in ("solver", "coder")] == [1, 0]
    finally:
        again.store.close()


def test_a_node_asks_only_for_the_policies_it_has_room_for(tmp_path: Path) -> None:
    """A rollout node whose groups of one policy wait for that policy's trainers (down, or
    done) asks for the others' work only: no grant of the waiting policy, not even a
    regrant, and a policy the coordinator does not know is refused."""
    config = config_from_dict(
        {
            "envs": [{"name": "arithmetic"}, {"name": "python_code"}],
            "policies": [
                {"name": "solver", "envs": ["arithmetic"]},
                {"name": "coder", "envs": ["python_code"]},
            ],
            "run": {"dir": str(tmp_path)},
            "coordinator": {"lease_s": 10.0},
        }
    )
    coordinator = Coordinator(config)
    coordinator.store = Store(tmp_path / "coordinator.sqlite", lease_s=10.0)
    try:
        first = coordinator.handle(WorkRequest(node_id="gone", max_groups=4), 0.0)
        assert isinstance(first, WorkGrants)
        assert coordinator.store.expire_silent(now=20.0)  # its grants wait for a regrant
        reply = coordinator.handle(WorkRequest(node_id="r", max_groups=6, policies=["coder"]), 21.0)
        assert isinstance(reply, WorkGrants) and len(reply.grants) == 6
        assert {g.policy for g in reply.grants} == {"coder"}
        regranted = {g.task.id for g in first.grants if g.policy == "coder"}
        assert regranted <= {g.task.id for g in reply.grants}  # its own policy's regrants
        refused = coordinator.handle(
            WorkRequest(node_id="r", max_groups=1, policies=["critic"]), 22.0
        )
        assert isinstance(refused, Error) and "no policy 'critic' here" in refused.message
        solver = coordinator.handle(WorkRequest(node_id="r", max_groups=2), 23.0)
        assert isinstance(solver, WorkGrants)
        assert [g.policy for g in solver.grants] == ["solver", "solver"]  # the regrants
    finally:
        coordinator.store.close()
