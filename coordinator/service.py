"""The coordinator role: grants (env, task) work under leases, records outcomes, survives restarts.

    rollout node ── Hello / WorkRequest / GroupReport / Heartbeat / StatusRequest ──┐
                ◀── Welcome / WorkGrants / Ok / CoordinatorStatus / Error ────────┐ │
                                                                                  │ ▼
                        Server (ZMQ ROUTER on coordinator.endpoint) ──▶ Coordinator.handle(msg, now)
                                                                        │            │
               Scheduler.choose(k, draw_rng(seed, issued), open_by_env)    Store (SQLite, WAL,
               Scheduler.observe(task, report)  ◀────────────────────────   one fsync'ed txn
               setup(): replay Store.accepted_reports() into Scheduler        per request)
    lease sweeper (every sweep_interval_s) ── Store.expire_silent ──▶ regrant queue ──▶ next grants
    metrics (every METRICS_EVERY_S)        ── Store.stats ──▶ <run dir>/metrics/coordinator.jsonl
    dashboard ── StatusRequest, MetricsRequest ──▶ status table, MetricsWriter.recent (in memory)

Leases are per node: every request from a node refreshes its `last_seen`, and a node silent for
longer than `coordinator.lease_s` loses its open grants, whose tasks go to the next WorkRequest.
The scheduler (`coordinator.scheduler`: uniform or envsched) keeps its statistics in memory and
rebuilds them at start by replaying every stored report in order, so a restart continues them.
The coordinator never imports torch; it is small and may be killed and restarted at any time.

How to run:  agentjet coordinator --config configs/coordinator.toml
        or:  python -m coordinator configs/coordinator.toml
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, assert_never

import msgspec

from agentjet import protocol
from agentjet.config import Config, policy_names, policy_view
from agentjet.identity import node_keys
from agentjet.logs import RepeatedLog
from agentjet.metrics import MetricsWriter
from agentjet.protocol import (
    CoordinatorReply,
    CoordinatorRequest,
    CoordinatorStatus,
    Error,
    GroupReport,
    Heartbeat,
    Hello,
    MetricsRequest,
    Ok,
    StatusRequest,
    Task,
    Welcome,
    WorkGrants,
    WorkRequest,
)
from agentjet.roles import print_join_command, run_role, supervise
from agentjet.transport import Server
from coordinator.beacon import Beacon
from coordinator.envsched_status import status_table
from coordinator.scheduler import (
    Scheduler,
    draw_rng,
    make_scheduler,
    share_out,
    sweep_interval_s,
)
from coordinator.store import Accepted, Refused, Store

log = logging.getLogger(__name__)

# One WorkRequest asks for at most this many groups (bounds one reply and one transaction).
MAX_GROUPS_PER_REQUEST = 1024
# A work request names at most this many policies (the ones its node has room for).
MAX_POLICIES_PER_REQUEST = 256
# Longer node ids are refused: they key the nodes table and show up in every status reply.
MAX_NODE_ID_CHARS = 128
# Longer role names in heartbeats are refused (real roles are a single short word).
MAX_ROLE_CHARS = 32
# A group report carries at most this many rewards (config caps rollout.group_size at 256).
MAX_REWARDS_PER_REPORT = 1024
# A metrics row every this many seconds: frequent enough for a live plot, cheap on disk.
METRICS_EVERY_S = 10.0
# The status table's grant shares count this many of the newest grants (64 batches of 8).
RECENT_GRANTS = 512


def db_path(config: Config) -> Path:
    """The history file: `coordinator.db_path`, or `<run dir>/coordinator.sqlite`."""
    path = config.coordinator.db_path or str(Path(config.run.dir) / "coordinator.sqlite")
    return Path(path).expanduser()


def request_problem(msg: CoordinatorRequest) -> str | None:
    """Why a decoded request cannot be served (answered with Error "invalid"), or None."""
    node_id = protocol.claimed_node_id(msg)
    if node_id is not None and not 0 < len(node_id) <= MAX_NODE_ID_CHARS:
        return f"node_id must have 1 to {MAX_NODE_ID_CHARS} characters"
    match msg:
        case WorkRequest(max_groups=n) if not 0 < n <= MAX_GROUPS_PER_REQUEST:
            return f"max_groups is {n}; ask for 1 to {MAX_GROUPS_PER_REQUEST} groups"
        case WorkRequest(policies=names) if len(names) > MAX_POLICIES_PER_REQUEST:
            return f"{len(names)} policies; a request names at most {MAX_POLICIES_PER_REQUEST}"
        case WorkRequest(policy_version=v) | Heartbeat(policy_version=v) if v < 0:
            return f"policy_version is {v}; versions start at 0"
        case Heartbeat(role=role) if len(role) > MAX_ROLE_CHARS:
            return f"role must have at most {MAX_ROLE_CHARS} characters"
        case GroupReport() if len(msg.rewards) > MAX_REWARDS_PER_REPORT:
            return f"{len(msg.rewards)} rewards; a group has at most {MAX_REWARDS_PER_REPORT}"
        case GroupReport() if not all(math.isfinite(r) for r in msg.rewards):
            return "rewards must be finite numbers"
        case GroupReport() if msg.completion_tokens < 0 or not (
            math.isfinite(msg.turns) and math.isfinite(msg.wall_s)
        ):
            return "completion_tokens must be >= 0 and turns, wall_s finite"
    return None


class RewardWindow:
    """Mean reward of the groups reported since the last metrics row."""

    def __init__(self) -> None:
        self.reports = 0
        self.groups_with_rewards = 0
        self.sum_of_means = 0.0

    def add(self, rewards: list[float]) -> None:
        self.reports += 1
        if rewards:
            self.groups_with_rewards += 1
            self.sum_of_means += sum(rewards) / len(rewards)

    def mean(self) -> float | None:
        return self.sum_of_means / self.groups_with_rewards if self.groups_with_rewards else None


class Coordinator:
    """The role: `setup()` opens the history and binds the socket, `run()` serves until stopped.

    Attributes made in `setup()` are released by the `cleanup` stack it is given.
    """

    store: Store
    server: Server
    metrics: MetricsWriter

    def __init__(
        self,
        config: Config,
        scheduler: Scheduler | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        # One scheduler per policy, each over its environments, with statistics of its own.
        self.schedulers: dict[str, Scheduler] = {
            name: make_scheduler(policy_view(config, name)) for name in policy_names(config)
        }
        if scheduler is not None:
            self.schedulers[next(iter(self.schedulers))] = scheduler
        self.shares = {p.name: p.weight for p in config.policies} or {"": 1.0}
        self.clock = clock  # wall clock: lease times are stored and must survive a restart
        self.node_id = f"coordinator-{socket.gethostname()}-{os.getpid()}"
        self.beacon: Beacon | None = None  # with coordinator.publish
        self.db_path = db_path(config)
        self.started_at = 0.0
        self.invalid_requests = 0
        # A node may send one invalid request after another: a line, then counts.
        self.invalid_log = RepeatedLog(
            log,
            "refused {detail}",
            "refused {count} more requests in the last {seconds:.0f} s; the last: {detail}",
            level=logging.INFO,
        )
        self.reward_window = RewardWindow()

    def setup(self, cleanup: ExitStack) -> None:
        keys = node_keys(self.config.net, self.node_id)
        if keys is not None:  # a node's own key file names it
            self.node_id = keys.name
        self.started_at = self.clock()
        cleanup.callback(self.invalid_log.flush)
        self.store = Store(self.db_path, lease_s=self.config.coordinator.lease_s)
        cleanup.callback(self.store.close)
        self._replay_reports()
        self.server = Server(
            self.config.coordinator.endpoint,
            protocol.coordinator_request_decoder,
            self.config.net.max_message_bytes,
            keys,
        )
        cleanup.callback(self.server.close)
        self.metrics = MetricsWriter(self.config.run.dir, "coordinator", self.config.log)
        cleanup.callback(self.metrics.close)
        log.info("coordinator serving on %s, history in %s", self.server.endpoint, self.db_path)
        if self.config.coordinator.publish:
            self._publish(cleanup)

    def _publish(self, cleanup: ExitStack) -> None:
        """Put this coordinator in the swarm's directory, where rollout nodes look for it."""
        swarm = self.config.swarm
        record = protocol.NodeRecord(
            node_id=self.node_id,
            role="coordinator",
            endpoint=swarm.announce_endpoint or self.server.endpoint,
        )
        beacon = Beacon(swarm, record, self.config.net.keys)
        cleanup.callback(beacon.close)
        self.beacon = beacon
        log.info("coordinator is in the swarm's directory: %s", " ".join(beacon.maddrs))
        if not swarm.initial_peers:
            print_join_command(beacon.maddrs, self.config.net.keys)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set; a background loop that fails ends the run with its error."""
        loops = {
            "coordinator-serve": self._serve(),
            "coordinator-lease-sweeper": self._sweep_leases(),
            "coordinator-metrics": self._write_metrics_periodically(),
        }
        if self.beacon is not None and self.server.keys is not None:
            # Revocations the beacon reads in the swarm: refused from the next request on.
            loops["coordinator-revocations"] = self.beacon.take_revocations(
                self.server.keys.membership
            )
        await supervise(stop, loops)
        self._write_metrics()

    # ── requests ──────────────────────────────────────────────────────────────────────

    def handle(self, msg: CoordinatorRequest, now: float) -> CoordinatorReply:
        """Answer one decoded request; state changes are committed before the reply is sent."""
        problem = request_problem(msg)
        if problem is not None:
            return self._refuse(msg, problem)
        match msg:
            case Hello():
                welcome = protocol.answer_hello(msg, run_id=self.config.swarm.run_id)
                if isinstance(welcome, Welcome) and msg.role != "client":
                    self.store.touch(msg.node_id, now, role=msg.role)
                return welcome
            case WorkRequest():
                unknown = sorted(set(msg.policies) - set(self.shares))
                if unknown:
                    served = ", ".join(p for p in self.shares if p) or "no [[policies]]"
                    return self._refuse(msg, f"no policy {unknown[0]!r} here ({served})")
                wanted = msg.policies or list(self.shares)
                grants = self.store.grant(
                    msg.node_id,
                    msg.max_groups,
                    now,
                    self.config.rollout.group_size,
                    lambda count, issued: self._draw_new(count, issued, wanted),
                    msg.policy_version,
                    policies=wanted if msg.policies else None,
                )
                log.debug("granted %d groups to %s", len(grants), msg.node_id)
                return WorkGrants(grants=grants)
            case GroupReport():
                match self.store.complete(msg, now):
                    case Accepted(task=task, policy=policy):
                        self._scheduler(policy).observe(task, msg)
                        self.reward_window.add(msg.rewards)
                        return Ok()
                    case Refused(reason=reason):
                        return self._refuse(msg, reason)
            case Heartbeat():
                self.store.touch(msg.node_id, now, msg.role, msg.policy_version)
                return Ok()
            case StatusRequest():
                return self.status(now)
            case MetricsRequest():
                return self.metrics.recent.answer(msg)
            case _:
                assert_never(msg)

    @property
    def scheduler(self) -> Scheduler:
        """The first policy's scheduler (the only one without [[policies]])."""
        return next(iter(self.schedulers.values()))

    def _scheduler(self, policy: str) -> Scheduler:
        # A grant of a policy since removed from the config: learnt by the first policy's.
        return self.schedulers.get(policy) or self.scheduler

    def status(self, now: float) -> CoordinatorStatus:
        stats = self.store.stats()
        table = []
        for policy, scheduler in self.schedulers.items():
            recent = self.store.recent_tasks(
                RECENT_GRANTS, policy if self.config.policies else None
            )
            rows = status_table(
                scheduler.statistics, recent, scheduler.target_weights(stats.grants_issued)
            )
            # With [[policies]], each policy's rows are named POLICY/NAME.
            table += [
                msgspec.structs.replace(row, name=f"{policy}/{row.name}") if policy else row
                for row in rows
            ]
        return CoordinatorStatus(
            grants_issued=stats.grants_issued,
            grants_completed=stats.grants_completed,
            grants_expired=stats.grants_expired,
            leases_open=stats.leases_open,
            nodes={node: now - seen for node, seen in stats.nodes_last_seen.items()},
            rejected_messages=self.server.rejected + self.invalid_requests,
            scheduler=self.config.coordinator.scheduler,
            regrants_queued=stats.regrants_queued,
            recent_grants=min(stats.grants_issued, RECENT_GRANTS),
            table=table,
            denied_handshakes=self.server.denied,
            refused=self.server.refused,
        )

    def _draw_new(
        self, count: int, grants_issued: int, policies: list[str] | None = None
    ) -> list[tuple[Task, str]]:
        """`count` new (task, policy) picks: the policies (of `policies`, the ones the node
        has room for) by their shares, then each policy's scheduler its tasks."""
        rng = draw_rng(self.config.run.seed, grants_issued)
        shares = {p: w for p, w in self.shares.items() if policies is None or p in policies}
        split = share_out(count, shares, self.store.grants_by_policy())
        open_by_env = self.store.open_by_env()
        picks: list[tuple[Task, str]] = []
        for policy, k in split.items():
            tasks = self._scheduler(policy).choose(k, rng, open_by_env, grants_issued)
            picks += [(task, policy) for task in tasks]
        return picks

    def _replay_reports(self) -> None:
        """Feed the scheduler every stored report, in order: its statistics are as they were
        when the last coordinator stopped (decay counts reports, not seconds)."""
        start, replayed = time.perf_counter(), 0
        for task, policy, report in self.store.accepted_reports_by_policy():
            self._scheduler(policy).observe(task, report)
            replayed += 1
        if replayed:
            log.info(
                "scheduler statistics rebuilt from %d reports in %.2f s",
                replayed,
                time.perf_counter() - start,
            )

    def _refuse(self, msg: CoordinatorRequest, reason: str) -> Error:
        self.invalid_requests += 1
        self.invalid_log.note(f"{type(msg).__name__}: {reason}")
        return Error(code="invalid", message=reason)

    # ── loops ─────────────────────────────────────────────────────────────────────────

    async def _serve(self) -> None:
        while True:
            envelope, msg = await self.server.recv()
            await self.server.reply(envelope, self.handle(msg, self.clock()))

    async def _sweep_leases(self) -> None:
        lease_s = self.config.coordinator.lease_s
        while True:
            await asyncio.sleep(sweep_interval_s(lease_s))
            # Nodes cannot reach a coordinator that is down: count silence from our own start.
            gone = self.store.expire_silent(self.clock(), not_before=self.started_at)
            if gone:
                log.info(
                    "%d leases expired (node silent > %.1f s); their tasks will be granted again",
                    len(gone),
                    lease_s,
                )

    async def _write_metrics_periodically(self) -> None:
        while True:
            await asyncio.sleep(METRICS_EVERY_S)
            self._write_metrics()

    def _write_metrics(self) -> None:
        stats = self.store.stats()
        row: dict[str, Any] = {
            "coordinator/grants_issued": stats.grants_issued,
            "coordinator/grants_completed": stats.grants_completed,
            "coordinator/grants_expired": stats.grants_expired,
            "coordinator/leases_open": stats.leases_open,
            "coordinator/regrants_queued": stats.regrants_queued,
            "coordinator/nodes": len(stats.nodes_last_seen),
            "coordinator/rejected_messages": self.server.rejected + self.invalid_requests,
            "coordinator/denied_handshakes": self.server.denied,
            **{f"coordinator/refused_{kind}": n for kind, n in self.server.refused.items()},
            "coordinator/reports": self.reward_window.reports,
            "charts/mean_reward": self.reward_window.mean(),
        }
        self.metrics.write(row)
        self.reward_window = RewardWindow()


def main(config: Config) -> int:
    """Run the coordinator on uvloop until SIGINT or SIGTERM; returns the exit status."""
    return run_role(Coordinator(config), "coordinator")
