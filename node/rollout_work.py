"""The rollout node's link to the coordinator: work requests (tasks drawn locally while the
coordinator is away), group reports and heartbeats.

In node/rollout.py's drawing this is "coordinator ──WorkGrants──▶ produce" and the report
task's "GroupReport ──▶ coordinator"; the coordinator's client is node/rollout_peers.py's.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections import defaultdict

import msgspec

from agentjet import protocol
from agentjet.config import Config
from agentjet.episode import Episode
from agentjet.tasks import TaskSource, draw_tasks
from agentjet.transport import PeerUnavailable
from node.engine import Engine
from node.rollout_delivery import Backpressure
from node.rollout_peers import Peers

log = logging.getLogger(__name__)

# Back-off bounds when the coordinator does not answer.
RETRY_MIN_S, RETRY_MAX_S = 0.5, 10.0
# While the coordinator is away, each batch first asks it for this long, then goes local.
FALLBACK_PROBE_S = 1.0
LOCAL_GRANT_PREFIX = "local-"


class Work:
    """Where this node's work comes from, and what the coordinator hears of it. `engine`:
    the versions this node samples with; `counts`: the node's metrics counters."""

    def __init__(
        self,
        node_id: str,
        config: Config,
        engine: Engine,
        peers: Peers,
        backpressure: Backpressure,
        counts: defaultdict[str, int],
    ) -> None:
        self.node_id = node_id
        self.config = config
        self.engine = engine
        self.peers = peers
        self.backpressure = backpressure
        self.counts = counts
        self.sources = [TaskSource.from_config(env) for env in config.envs]
        for source in self.sources:
            if source.skipped:
                counts[f"tasks_skipped/{source.env}"] = source.skipped
        self.rng = random.Random(config.run.seed)
        self.coordinator_away = False
        self.reports: asyncio.Queue[protocol.GroupReport] = asyncio.Queue()

    async def request(self) -> list[protocol.WorkGrant]:
        """Grants from the coordinator; while it does not answer, tasks drawn locally."""
        request = protocol.WorkRequest(
            node_id=self.node_id,
            max_groups=self.config.rollout.groups_per_batch,
            policy_version=self.engine.policy_version,
            policies=self.backpressure.with_room() if self.config.policies else [],
        )
        delay = RETRY_MIN_S
        while True:
            try:
                reply = await self._ask(request)
            except PeerUnavailable as e:
                if not self.coordinator_away:
                    log.warning("%s; drawing tasks locally until it is back", e)
                self.coordinator_away = True
                return self.local_grants()
            if self.coordinator_away:
                log.info("coordinator is back")
                self.coordinator_away = False
            if isinstance(reply, protocol.WorkGrants) and reply.grants:
                return reply.grants
            if isinstance(reply, protocol.Error):
                log.warning("coordinator refused work request: %s", reply.message)
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)

    def coordinator_timeout(self) -> float | None:
        """Once the coordinator has gone silent, ask it only briefly (the default otherwise)."""
        return FALLBACK_PROBE_S if self.coordinator_away else None

    def local_grants(self) -> list[protocol.WorkGrant]:
        """The local fallback: uniform tasks from this node's own task sources.

        Their groups are trained like any other; the coordinator never hears of them (it
        has no grant to attach them to), so its scheduler learns nothing from them. With
        [[policies]], each task goes to one of the policies that train its environment, by
        their weights.
        """
        cfg = self.config
        weights = [e.weight for e in cfg.envs]
        tasks = draw_tasks(self.rng, self.sources, weights, cfg.rollout.groups_per_batch)
        self.counts["local_grants"] += len(tasks)
        room = self.backpressure.with_room()
        return [
            protocol.WorkGrant(
                grant_id=f"{LOCAL_GRANT_PREFIX}{uuid.uuid4().hex}",
                task=task,
                policy=self.local_policy(task.env, room),
                group_size=cfg.rollout.group_size,
                lease_s=0.0,
            )
            for task in tasks
        ]

    def local_policy(self, env: str, room: list[str]) -> str:
        """A policy with room that trains `env`, by weight ("": none, or no [[policies]])."""
        training = [
            p for p in self.config.policies if (not p.envs or env in p.envs) and p.name in room
        ]
        if not training:
            return ""
        return self.rng.choices([p.name for p in training], [p.weight for p in training])[0]

    def queue_report(
        self, grant: protocol.WorkGrant, episodes: list[Episode], wall_s: float, error: str
    ) -> None:
        if grant.grant_id.startswith(LOCAL_GRANT_PREFIX):
            return
        errors = [e.error for e in episodes if e.error]
        self.reports.put_nowait(
            protocol.GroupReport(
                node_id=self.node_id,
                grant_id=grant.grant_id,
                rewards=[e.reward for e in episodes],
                completion_tokens=sum(len(e.completion_ids) for e in episodes),
                turns=sum(e.turns for e in episodes) / max(len(episodes), 1),
                wall_s=wall_s,
                failed=bool(error),
                error=error or (errors[0] if errors else ""),
            )
        )

    async def report(self) -> None:
        """Send each queued report, retrying while the coordinator does not answer."""
        while True:
            report = await self.reports.get()
            delay = RETRY_MIN_S
            while True:
                try:
                    reply = await self._ask(report)
                    break
                except PeerUnavailable:
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, RETRY_MAX_S)
            if isinstance(reply, protocol.Error):
                log.warning("coordinator refused report %s: %s", report.grant_id, reply.message)

    async def _ask(self, msg: msgspec.Struct) -> object:
        """`msg` to the coordinator, briefly while it has gone silent; PeerUnavailable while
        the swarm's directory names none."""
        coordinator = self.peers.coordinator
        if coordinator is None:
            raise PeerUnavailable("no coordinator in the swarm's directory")
        return await coordinator.request(msg, self.coordinator_timeout())

    async def heartbeat(self) -> None:
        interval_s = self.config.coordinator.lease_s / 4  # several beats per lease
        beat = protocol.Heartbeat(node_id=self.node_id, role="rollout")
        while True:
            await asyncio.sleep(interval_s)
            beat.policy_version = self.engine.policy_version
            coordinator = self.peers.coordinator
            if coordinator is None:
                continue
            try:
                await coordinator.request(beat, self.coordinator_timeout())
            except PeerUnavailable:
                log.warning("coordinator missed a heartbeat")
