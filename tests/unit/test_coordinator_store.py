"""The coordinator's history: grants, reports, expiry and re-granting, across reopening."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import pytest

from agentjet.config import EnvConfig
from agentjet.protocol import GroupReport, Task, WorkGrant
from coordinator.scheduler import UniformScheduler, draw_rng
from coordinator.store import Accepted, HistoryError, Refused, Store

pytestmark = pytest.mark.unit

LEASE_S = 10.0
GROUP_SIZE = 4


class Draws:
    """A scheduler callback that records how it was called."""

    def __init__(self) -> None:
        self.scheduler = UniformScheduler([EnvConfig(difficulties=[3])])
        self.calls: list[tuple[int, int]] = []

    def __call__(self, count: int, grants_issued: int) -> Sequence[Task]:
        self.calls.append((count, grants_issued))
        return self.scheduler.choose(count, draw_rng(0, grants_issued))


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "run" / "coordinator.sqlite"


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    store = Store(db_path, lease_s=LEASE_S)
    yield store
    store.close()


def grant(
    store: Store, node: str, k: int, now: float, draws: Draws | None = None
) -> list[WorkGrant]:
    return store.grant(node, k, now, GROUP_SIZE, draws or Draws())


def report(g: WorkGrant, node: str = "node-a", rewards: list[float] | None = None) -> GroupReport:
    return GroupReport(node_id=node, grant_id=g.grant_id, rewards=rewards or [1.0, 0.0, 0.0, 1.0])


def test_grant_then_complete_is_counted_once(store: Store) -> None:
    grants = grant(store, "node-a", 3, now=1000.0)
    assert len({g.grant_id for g in grants}) == 3
    assert all(g.lease_s == LEASE_S and g.group_size == GROUP_SIZE for g in grants)

    assert store.complete(report(grants[0]), now=1001.0) == Accepted(grants[0].task, late=False)

    stats = store.stats()
    assert (stats.grants_issued, stats.grants_completed, stats.grants_expired) == (3, 1, 0)
    assert stats.leases_open == 2
    assert stats.nodes_last_seen == {"node-a": 1001.0}


def test_a_second_report_for_a_grant_is_refused(store: Store) -> None:
    (g,) = grant(store, "node-a", 1, now=0.0)
    assert isinstance(store.complete(report(g), now=1.0), Accepted)
    refused = store.complete(report(g), now=2.0)
    assert isinstance(refused, Refused)
    assert "already completed" in refused.reason
    assert store.stats().grants_completed == 1


def test_reports_for_unknown_or_foreign_grants_are_refused(store: Store) -> None:
    (g,) = grant(store, "node-a", 1, now=0.0)
    unknown = GroupReport(node_id="node-a", grant_id="no-such-grant", rewards=[1.0])
    assert "unknown" in _reason(store.complete(unknown, now=1.0))
    assert "granted to node node-a" in _reason(store.complete(report(g, node="node-b"), now=1.0))
    assert "for a group of 4" in _reason(store.complete(report(g, rewards=[0.0] * 5), now=1.0))
    assert store.stats().grants_completed == 0
    assert isinstance(store.complete(report(g), now=2.0), Accepted)


def test_an_expired_grant_is_granted_again_exactly_once(store: Store) -> None:
    lost = grant(store, "node-a", 2, now=0.0)
    store.touch("node-b", now=8.0, role="rollout")

    assert store.expire_silent(now=LEASE_S) == []
    assert sorted(store.expire_silent(now=LEASE_S + 0.5)) == sorted(g.grant_id for g in lost)
    assert store.expire_silent(now=LEASE_S + 1.0) == []  # expired once, not again
    assert store.queued_tasks() == [g.task for g in lost]
    stats = store.stats()
    assert (stats.grants_expired, stats.leases_open, stats.regrants_queued) == (2, 0, 2)

    draws = Draws()
    regranted = grant(store, "node-b", 3, now=11.0, draws=draws)
    assert [g.task for g in regranted[:2]] == [g.task for g in lost]
    assert {g.grant_id for g in regranted}.isdisjoint(g.grant_id for g in lost)
    assert draws.calls == [(1, 2)]  # only the third came from the scheduler
    assert store.queued_tasks() == []

    again = grant(store, "node-b", 2, now=12.0, draws=draws)
    assert draws.calls[-1] == (2, 5)
    assert not {g.task.id for g in again} & {g.task.id for g in lost}
    assert store.stats().grants_issued == 7


def test_contact_keeps_a_nodes_leases_alive(store: Store) -> None:
    (g,) = grant(store, "node-a", 1, now=0.0)
    store.touch("node-a", now=9.0)
    assert store.expire_silent(now=15.0) == []
    assert store.expire_silent(now=19.5) == [g.grant_id]


def test_a_late_report_completes_an_expired_grant_and_cancels_its_regrant(store: Store) -> None:
    (g,) = grant(store, "node-a", 1, now=0.0)
    store.expire_silent(now=LEASE_S + 1.0)
    assert store.complete(report(g), now=LEASE_S + 2.0) == Accepted(g.task, late=True)
    assert store.queued_tasks() == []
    stats = store.stats()
    assert (stats.grants_completed, stats.grants_expired, stats.leases_open) == (1, 1, 0)
    assert isinstance(store.complete(report(g), now=LEASE_S + 3.0), Refused)


def test_reopening_the_file_restores_the_same_state(store: Store, db_path: Path) -> None:
    done, still_open = grant(store, "node-a", 2, now=0.0)
    lost = grant(store, "node-b", 1, now=0.0)
    store.touch("node-a", now=15.0, role="rollout", policy_version=3)
    store.complete(report(done), now=15.0)
    store.expire_silent(now=15.0)
    before = (store.stats(), store.open_leases(), store.queued_tasks())
    store.close()

    reopened = Store(db_path, lease_s=LEASE_S)
    try:
        assert (reopened.stats(), reopened.open_leases(), reopened.queued_tasks()) == before
        assert [lease.grant_id for lease in reopened.open_leases()] == [still_open.grant_id]
        assert reopened.queued_tasks() == [lost[0].task]
        assert isinstance(reopened.complete(report(done), now=16.0), Refused)
        draws = Draws()
        grant(reopened, "node-a", 2, now=16.0, draws=draws)
        assert draws.calls == [(1, 3)]  # the rng seed continues from the issued count
    finally:
        reopened.close()


def test_a_file_from_a_newer_coordinator_is_refused(db_path: Path) -> None:
    Store(db_path, lease_s=LEASE_S).close()
    with sqlite3.connect(db_path) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(HistoryError, match="newer coordinator"):
        Store(db_path, lease_s=LEASE_S)


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a database, just some text that is long enough " * 20)
    with pytest.raises(HistoryError, match="not a coordinator history"):
        Store(path, lease_s=LEASE_S)


def _reason(outcome: Accepted | Refused) -> str:
    assert isinstance(outcome, Refused), outcome
    return outcome.reason


def test_a_grant_keeps_its_policy_through_expiry_regrant_report_and_reopening(
    store: Store, db_path: Path
) -> None:
    tasks = Draws().scheduler.choose(3, draw_rng(0, 0))
    picks = [(tasks[0], "planner"), (tasks[1], "solver"), (tasks[2], "solver")]
    granted = store.grant("node-a", 3, 0.0, GROUP_SIZE, lambda count, issued: picks[:count])
    assert [g.policy for g in granted] == ["planner", "solver", "solver"]
    assert store.grants_by_policy() == {"planner": 1, "solver": 2}
    store.expire_silent(now=LEASE_S + 1)
    [again] = grant(store, "node-b", 1, now=LEASE_S + 2)  # the oldest expired: planner's
    assert (again.task, again.policy) == (tasks[0], "planner")
    accepted = store.complete(report(again, "node-b"), now=LEASE_S + 3)
    assert isinstance(accepted, Accepted) and accepted.policy == "planner"
    store.close()
    reopened = Store(db_path, lease_s=LEASE_S)
    try:
        [(task, policy, _)] = list(reopened.accepted_reports_by_policy())
        assert (task, policy) == (tasks[0], "planner")
        assert reopened.recent_tasks(10, "solver") == [tasks[2], tasks[1]]
    finally:
        reopened.close()


def test_a_history_of_schema_1_gains_the_policy_column_and_keeps_its_grants(
    db_path: Path,
) -> None:
    db_path.parent.mkdir(parents=True)
    old = sqlite3.connect(db_path)
    old.executescript(
        """CREATE TABLE grants (grant_id TEXT PRIMARY KEY, task TEXT NOT NULL, env TEXT NOT NULL,
        task_id TEXT NOT NULL, node_id TEXT NOT NULL, group_size INTEGER NOT NULL,
        state TEXT NOT NULL, granted_at REAL NOT NULL, lease_until REAL NOT NULL,
        done_at REAL, expired_at REAL, regrant_of TEXT REFERENCES grants(grant_id));
        PRAGMA user_version = 1;"""
    )
    task = Draws().scheduler.choose(1, draw_rng(0, 0))[0]
    old.execute(
        "INSERT INTO grants VALUES ('g1', ?, ?, ?, 'node-a', 4, 'open', 0, 10, NULL, NULL, NULL)",
        (msgspec.json.encode(task).decode(), task.env, task.id),
    )
    old.commit()
    old.close()
    store = Store(db_path, lease_s=LEASE_S)
    try:
        assert store.grants_by_policy() == {"": 1}
        outcome = store.complete(
            GroupReport(node_id="node-a", grant_id="g1", rewards=[1.0]), now=1.0
        )
        assert isinstance(outcome, Accepted) and (outcome.task, outcome.policy) == (task, "")
    finally:
        store.close()
    assert sqlite3.connect(db_path).execute("PRAGMA user_version").fetchone()[0] == 2
