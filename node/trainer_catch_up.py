"""A trainer catching up with the swarm: other trainers moved past its version, its version
is withheld, a peer's weights hold a batch it was in doubt about, or it was cut off.

    CatchUp.run: the swarm's state from a peer (weights, optimizer state, version;
        SwarmOptimizer.load_state_from_peers) ──▶ the head moves to its version
        ──▶ the groups its logged steps trained: those the weights hold are trained
            (GroupBook.adopt), the rest of its undurable ones go back to rollout nodes
        ──another lineage──▶ its replay buffer is emptied, the lineage is recorded
        ──▶ the version published (unless a peer's withheld one) ──▶ "caught_up" row
    CatchUp.sit_out_isolation: cut off (node/trainer_peers.py `connected`) ──▶ wait until
        back ──▶ drop the groups held meanwhile ──▶ run
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from agentjet.bridge import blocking
from agentjet.metrics import MetricsWriter
from node.groups import TRAINED_LOG, GroupBook, read_trained_log
from node.publisher import Publisher
from node.replay import Replay
from node.swarm import SwarmOptimizer
from node.trainer_intake import Head
from node.trainer_lineage import record_lineage, swarm_lineage
from node.trainer_peers import Peers
from node.trainer_versions import Versions

log = logging.getLogger(__name__)


@dataclass
class CatchUp:
    """Takes the swarm's state into a trainer (see the module docstring)."""

    run_dir: Path
    head: Head
    book: GroupBook
    replay: Replay
    swarm: SwarmOptimizer
    peers: Peers
    versions: Versions
    publisher: Publisher
    metrics: MetricsWriter
    counts: Counter[str]

    async def run(self) -> None:
        """Take the swarm's current state (weights, optimizer state, version)."""
        head = self.head
        downloaded = await blocking(self.swarm.load_state_from_peers)
        if not downloaded:
            return
        if self.swarm.epoch != head.version:
            log.info(
                "caught up with the swarm: policy version %d -> %d",
                head.version,
                self.swarm.epoch,
            )
            self.counts["catch_ups"] += 1
        head.version = self.swarm.epoch
        lineage = swarm_lineage(self.peers.others.values(), head.lineage)
        steps = await blocking(read_trained_log, self.run_dir / TRAINED_LOG)
        forgotten = self.book.adopt(steps, lineage, head.version)
        if lineage.id != head.lineage.id:
            log.warning(
                "took the swarm's weights (lineage %s); %d groups of this trainer's own "
                "lineage %s go back to rollout nodes",
                lineage.id,
                forgotten,
                head.lineage.id,
            )
            head.lineage = lineage
            record_lineage(self.run_dir, head.lineage)
            self.replay.clear()  # no importance ratio across lineages
        if self.swarm.withheld:
            log.info("version %d is a peer's withheld one: withheld here too", head.version)
        else:
            await self.versions.publish()
        self.metrics.write(
            {
                "event": "caught_up",
                "policy_version": head.version,
                "version_withheld": self.swarm.withheld,
                "lineage": head.lineage.id,
                "lineage_ancestors": head.lineage.ancestors,
                "policy_sha256": self.publisher.published.sha256,
            }
        )

    async def sit_out_isolation(self) -> None:
        """Train nothing while cut off: alone, this trainer would make its own versions.
        Back in touch, it drops what it held (rollout nodes have sent those groups to the
        trainers they could still reach, when its record expired) and catches up."""
        await self.peers.connected.wait()
        dropped = self.book.forget_held()
        self.counts["groups_dropped_isolated"] += dropped
        log.info("dropped %d groups held while cut off; catching up", dropped)
        await self.run()
