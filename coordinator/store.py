"""The coordinator's durable history: SQLite in WAL mode, one fsync'ed transaction per request.

    WorkRequest ──▶ grant()        regrant_queue (oldest first), then draw_new(…) ──▶ grants(open)
    GroupReport ──▶ complete()     grants(open|expired) ──▶ grants(done) + reports
    sweep       ──▶ expire_silent() grants(open, node silent) ──▶ grants(expired) + regrant_queue
    any request ──▶ touch()        nodes.last_seen (leases are per node)

Every method is one transaction, so a coordinator killed at any point restarts on exactly the
state its last answer described: a completed grant stays completed (a second report for it is
refused), an open grant stays open, and a queued task is re-granted exactly once. The counters
table keeps `grants_issued`, which seeds the scheduler's rng so a restart continues the task
sequence instead of repeating it.
"""

from __future__ import annotations

import json
import math
import sqlite3
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import msgspec

from agentjet.errors import AgentjetError
from agentjet.protocol import GroupReport, Task, WorkGrant
from coordinator.scheduler import Lease, expired

# Bumped whenever the tables change; a file written by a newer coordinator is refused, an
# older one is brought up to date when opened (`_MIGRATIONS`).
# 2: grants.policy (several policies, issue 26).
SCHEMA_VERSION = 2

# Reports keep at most this much of a node's error text (the tail of a traceback is enough).
MAX_ERROR_CHARS = 2000

# A writer waits this long for the file lock (another process reading, a backup) before failing.
BUSY_TIMEOUT_S = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS grants (
    grant_id    TEXT PRIMARY KEY,
    task        TEXT NOT NULL,              -- protocol.Task as msgspec JSON
    env         TEXT NOT NULL,
    task_id     TEXT NOT NULL,
    node_id     TEXT NOT NULL,
    group_size  INTEGER NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('open', 'done', 'expired')),
    granted_at  REAL NOT NULL,              -- unix seconds
    lease_until REAL NOT NULL,              -- holder's last_seen + lease_s, refreshed on contact
    done_at     REAL,
    expired_at  REAL,                       -- set once; kept when a late report completes it
    regrant_of  TEXT REFERENCES grants(grant_id),
    policy      TEXT NOT NULL DEFAULT ''     -- [[policies]] name; '' = the one policy
);
CREATE INDEX IF NOT EXISTS grants_by_state_node ON grants(state, node_id);
CREATE TABLE IF NOT EXISTS regrant_queue (
    seq       INTEGER PRIMARY KEY AUTOINCREMENT,
    grant_id  TEXT NOT NULL UNIQUE REFERENCES grants(grant_id),  -- the expired grant
    queued_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS reports (
    grant_id          TEXT PRIMARY KEY REFERENCES grants(grant_id),
    node_id           TEXT NOT NULL,
    rewards           TEXT NOT NULL,        -- JSON list of floats, one per sample
    mean_reward       REAL,                 -- NULL when the group has no rewards
    completion_tokens INTEGER NOT NULL,
    turns             REAL NOT NULL,
    wall_s            REAL NOT NULL,
    failed            INTEGER NOT NULL,
    error             TEXT NOT NULL,
    late              INTEGER NOT NULL,     -- 1 when the lease had expired before the report
    received_at       REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS nodes (
    id             TEXT PRIMARY KEY,
    role           TEXT NOT NULL,
    last_seen      REAL NOT NULL,
    policy_version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT OR IGNORE INTO counters (name, value) VALUES
    ('grants_issued', 0), ('grants_completed', 0), ('grants_expired', 0);
"""

# From schema version N - 1 to N (the key), run before _SCHEMA in the same transaction.
_MIGRATIONS = {2: "ALTER TABLE grants ADD COLUMN policy TEXT NOT NULL DEFAULT '';"}

_task_decoder = msgspec.json.Decoder(Task)


class HistoryError(AgentjetError):
    """The history file cannot be used (written by a newer version, or not a history file)."""


class Accepted(NamedTuple):
    """A report was recorded; `task` is what the grant handed out (the scheduler learns on it)."""

    task: Task
    late: bool  # the lease had expired before the report came
    policy: str = ""  # the grant's policy


class Refused(NamedTuple):
    """A report was not recorded, and why (sent back to the node)."""

    reason: str


class StoreStats(msgspec.Struct, frozen=True, kw_only=True):
    grants_issued: int
    grants_completed: int
    grants_expired: int
    leases_open: int
    regrants_queued: int
    nodes_last_seen: dict[str, float]  # node id -> unix seconds


# Draws `count` new tasks, given how many grants were issued before (to seed its rng): each a
# Task (for the one policy) or a (Task, policy name) pair.
DrawNew = Callable[[int, int], Sequence[Task | tuple[Task, str]]]


class Store:
    """The coordinator's history in one SQLite file; `lease_s` is how long a node may be silent."""

    def __init__(self, path: str | Path, lease_s: float) -> None:
        self.path = Path(path)
        self.lease_s = lease_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode: transactions are opened explicitly by `_transaction`.
        self._db = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_S)
        try:
            self._init_schema()
        except sqlite3.DatabaseError as e:
            self._db.close()
            raise HistoryError(f"{self.path} is not a coordinator history file ({e})") from None
        except HistoryError:
            self._db.close()
            raise

    def _init_schema(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise HistoryError(
                f"{self.path} was written by a newer coordinator (schema {version}, this one "
                f"reads {SCHEMA_VERSION}); upgrade agentjet or point coordinator.db_path elsewhere"
            )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a reply is sent only after its fsync
        self._db.execute("PRAGMA foreign_keys=ON")
        # One script, one transaction: every statement is idempotent, so reopening is harmless.
        # A file of an older schema (one with tables: version 0 is a new file) migrates first.
        has_tables = self._db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        migrations = "".join(
            _MIGRATIONS[v] for v in range(version + 1, SCHEMA_VERSION + 1) if has_tables
        )
        self._db.executescript(
            f"BEGIN IMMEDIATE; {migrations} {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION};"
            " COMMIT;"
        )

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()

    # ── requests ──────────────────────────────────────────────────────────────────────

    def touch(
        self, node_id: str, now: float, role: str = "", policy_version: int | None = None
    ) -> None:
        """A node was heard from: its leases stay alive for another `lease_s`."""
        with self._transaction():
            self._touch(node_id, now, role, policy_version)

    def grant(
        self,
        node_id: str,
        max_groups: int,
        now: float,
        group_size: int,
        draw_new: DrawNew,
        policy_version: int | None = None,
        policies: list[str] | None = None,
    ) -> list[WorkGrant]:
        """Grant `max_groups` tasks to `node_id`: re-queued tasks first (oldest first; of
        `policies` only, unless None), then `draw_new(count, grants_issued)`. Each grant gets
        a fresh id and the store's lease."""
        with self._transaction() as db:
            self._touch(node_id, now, "", policy_version)
            wanted = json.dumps(policies)  # (JSON null: any policy)
            queued = db.execute(
                "SELECT q.seq, g.grant_id, g.task, g.policy FROM regrant_queue q "
                "JOIN grants g ON g.grant_id = q.grant_id WHERE json(?) = 'null' OR g.policy IN"
                " (SELECT value FROM json_each(?)) ORDER BY q.seq LIMIT ?",
                (wanted, wanted, max_groups),
            ).fetchall()
            db.executemany("DELETE FROM regrant_queue WHERE seq = ?", [(q[0],) for q in queued])
            issued = self._counter("grants_issued")
            picks: list[tuple[Task, str, str | None]] = [
                (_task_decoder.decode(task_json), policy, old_id)
                for _, old_id, task_json, policy in queued
            ]
            for drawn in draw_new(max_groups - len(queued), issued):
                task, policy = (drawn, "") if isinstance(drawn, Task) else drawn
                picks.append((task, policy, None))
            grants = []
            for task, policy, regrant_of in picks:
                grant_id = uuid.uuid4().hex
                grant = WorkGrant(
                    grant_id=grant_id,
                    task=task,
                    group_size=group_size,
                    lease_s=self.lease_s,
                    policy=policy,
                )
                db.execute(
                    "INSERT INTO grants (grant_id, task, env, task_id, node_id, group_size,"
                    " state, granted_at, lease_until, regrant_of, policy)"
                    " VALUES (?, ?, ?, ?, ?, ?, 'open', ?, ?, ?, ?)",
                    (
                        grant_id,
                        msgspec.json.encode(task).decode(),
                        task.env,
                        task.id,
                        node_id,
                        group_size,
                        now,
                        now + self.lease_s,
                        regrant_of,
                        policy,
                    ),
                )
                grants.append(grant)
            self._add("grants_issued", len(grants))
            return grants

    def complete(self, report: GroupReport, now: float) -> Accepted | Refused:
        """Record a group's outcome, once. An expired grant may still complete (late): its work
        was done, so its task leaves the re-grant queue if it is still waiting there."""
        with self._transaction() as db:
            self._touch(report.node_id, now, "", None)
            row = db.execute(
                "SELECT task, node_id, group_size, state, policy FROM grants WHERE grant_id = ?",
                (report.grant_id,),
            ).fetchone()
            if row is None:
                return Refused(f"grant {report.grant_id} is unknown to this coordinator")
            task_json, holder, group_size, state, policy = row
            if state == "done":
                return Refused(f"grant {report.grant_id} was already completed")
            if holder != report.node_id:
                return Refused(
                    f"grant {report.grant_id} was granted to node {holder}, not {report.node_id}"
                )
            if len(report.rewards) > group_size:
                return Refused(
                    f"report has {len(report.rewards)} rewards for a group of {group_size}"
                )
            late = state == "expired"
            db.execute(
                "UPDATE grants SET state = 'done', done_at = ? WHERE grant_id = ?",
                (now, report.grant_id),
            )
            db.execute("DELETE FROM regrant_queue WHERE grant_id = ?", (report.grant_id,))
            db.execute(
                "INSERT INTO reports (grant_id, node_id, rewards, mean_reward, completion_tokens,"
                " turns, wall_s, failed, error, late, received_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    report.grant_id,
                    report.node_id,
                    json.dumps(report.rewards),
                    mean_reward(report.rewards),
                    report.completion_tokens,
                    report.turns,
                    report.wall_s,
                    int(report.failed),
                    report.error[-MAX_ERROR_CHARS:],
                    int(late),
                    now,
                ),
            )
            self._add("grants_completed", 1)
            return Accepted(_task_decoder.decode(task_json), late, policy)

    def expire_silent(self, now: float, not_before: float = -math.inf) -> list[str]:
        """Expire the open grants of nodes silent for longer than `lease_s` (silence counted from
        `not_before` at the earliest) and queue their tasks for re-granting. Returns their ids."""
        with self._transaction() as db:
            gone = expired(self._open_leases(), now, self.lease_s, not_before)
            for lease in gone:
                db.execute(
                    "UPDATE grants SET state = 'expired', expired_at = ? WHERE grant_id = ?",
                    (now, lease.grant_id),
                )
                db.execute(
                    "INSERT INTO regrant_queue (grant_id, queued_at) VALUES (?, ?)",
                    (lease.grant_id, now),
                )
            self._add("grants_expired", len(gone))
            return [lease.grant_id for lease in gone]

    # ── reading ───────────────────────────────────────────────────────────────────────

    def open_leases(self) -> list[Lease]:
        return self._open_leases()

    def queued_tasks(self) -> list[Task]:
        """Tasks of expired grants waiting to be granted again, in the order they will be."""
        rows = self._db.execute(
            "SELECT g.task FROM regrant_queue q JOIN grants g ON g.grant_id = q.grant_id "
            "ORDER BY q.seq"
        ).fetchall()
        return [_task_decoder.decode(task_json) for (task_json,) in rows]

    def accepted_reports(self) -> Iterator[tuple[Task, GroupReport]]:
        """Every recorded report with its grant's task, in the order they were accepted: the
        scheduler replays them to rebuild its statistics. Rows are never deleted and the file
        is never vacuumed, so rowid order is acceptance order."""
        for task, _, report in self.accepted_reports_by_policy():
            yield task, report

    def accepted_reports_by_policy(self) -> Iterator[tuple[Task, str, GroupReport]]:
        """`accepted_reports` with each grant's policy."""
        rows = self._db.execute(
            "SELECT g.task, g.policy, r.node_id, r.grant_id, r.rewards, r.completion_tokens,"
            " r.turns, r.wall_s, r.failed, r.error FROM reports r"
            " JOIN grants g ON g.grant_id = r.grant_id ORDER BY r.rowid"
        )
        for row in rows:
            task_json, policy, node_id, grant_id, rewards, tokens, turns, wall_s, failed, error = (
                row
            )
            yield (
                _task_decoder.decode(task_json),
                policy,
                GroupReport(
                    node_id=node_id,
                    grant_id=grant_id,
                    rewards=json.loads(rewards),
                    completion_tokens=tokens,
                    turns=turns,
                    wall_s=wall_s,
                    failed=bool(failed),
                    error=error,
                ),
            )

    def recent_tasks(self, limit: int, policy: str | None = None) -> list[Task]:
        """The tasks of the newest `limit` grants (of `policy` only, unless None), newest
        first."""
        rows = self._db.execute(
            "SELECT task FROM grants WHERE ? IS NULL OR policy = ? ORDER BY rowid DESC LIMIT ?",
            (policy, policy, limit),
        ).fetchall()
        return [_task_decoder.decode(task_json) for (task_json,) in rows]

    def grants_by_policy(self) -> dict[str, int]:
        """Grants issued per policy (what the policies' shares are steered by)."""
        rows = self._db.execute("SELECT policy, count(*) FROM grants GROUP BY policy").fetchall()
        return {policy: count for policy, count in rows}

    def open_by_env(self) -> dict[str, int]:
        """Open grants per environment (what capacity limits count)."""
        rows = self._db.execute(
            "SELECT env, count(*) FROM grants WHERE state = 'open' GROUP BY env"
        ).fetchall()
        return {env: count for env, count in rows}

    def stats(self) -> StoreStats:
        counters = dict(self._db.execute("SELECT name, value FROM counters").fetchall())
        (leases_open,) = self._db.execute(
            "SELECT count(*) FROM grants WHERE state = 'open'"
        ).fetchone()
        (queued,) = self._db.execute("SELECT count(*) FROM regrant_queue").fetchone()
        nodes = dict(self._db.execute("SELECT id, last_seen FROM nodes").fetchall())
        return StoreStats(
            grants_issued=counters["grants_issued"],
            grants_completed=counters["grants_completed"],
            grants_expired=counters["grants_expired"],
            leases_open=leases_open,
            regrants_queued=queued,
            nodes_last_seen=nodes,
        )

    # ── inside a transaction ──────────────────────────────────────────────────────────

    def _touch(self, node_id: str, now: float, role: str, policy_version: int | None) -> None:
        self._db.execute(
            "INSERT INTO nodes (id, role, last_seen, policy_version) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET last_seen = max(last_seen, excluded.last_seen), "
            "role = CASE WHEN excluded.role = '' THEN role ELSE excluded.role END, "
            "policy_version = CASE WHEN ? IS NULL THEN policy_version "
            "ELSE excluded.policy_version END",
            (node_id, role, now, policy_version or 0, policy_version),
        )
        self._db.execute(
            "UPDATE grants SET lease_until = ? WHERE state = 'open' AND node_id = ?",
            (now + self.lease_s, node_id),
        )

    def _open_leases(self) -> list[Lease]:
        rows = self._db.execute(
            "SELECT g.grant_id, g.node_id, n.last_seen FROM grants g "
            "JOIN nodes n ON n.id = g.node_id WHERE g.state = 'open'"
        ).fetchall()
        return [Lease(*row) for row in rows]

    def _counter(self, name: str) -> int:
        (value,) = self._db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return int(value)

    def _add(self, name: str, delta: int) -> None:
        self._db.execute("UPDATE counters SET value = value + ? WHERE name = ?", (delta, name))


def mean_reward(rewards: Sequence[float]) -> float | None:
    return sum(rewards) / len(rewards) if rewards else None
