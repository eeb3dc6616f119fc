"""A trainer's doubtful batches settled: those whose round failed on this side only, which a
peer may have stepped with all the same.

    GroupBook.doubtful ──batch ids──▶ their marks in the DHT (Directory.marked_batches)
        ──marked past this version──▶ catch up first (node/trainer_catch_up.py): the peer's
                                      weights hold them
        ──▶ GroupBook.settle (node/groups.py `settle`, read against the other trainers'
            versions): marked ──▶ trained in this version ("trained_by_peer" row);
            no peer took it ──▶ back to the queue (the next step may be ready)

The trainer role (node/trainer.py) settles them between steps while any wait.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agentjet.bridge import blocking
from agentjet.metrics import MetricsWriter
from node.directory import Directory
from node.groups import GroupBook
from node.trainer_intake import Head
from node.trainer_peers import Peers

log = logging.getLogger(__name__)


@dataclass
class Doubtful:
    """Settles a trainer's doubtful batches (see the module docstring)."""

    head: Head
    book: GroupBook
    directory: Directory
    peers: Peers
    catch_up: Callable[[], Awaitable[None]]  # take the swarm's state (CatchUp.run)
    metrics: MetricsWriter
    counts: Counter[str]
    batch_ready: asyncio.Event  # set when groups go back to the queue

    async def settle(self) -> None:
        """Look up the marks of the doubtful batches; mark trained the groups of those a
        peer stepped with, queue again those no peer took (`groups.settle`)."""
        ids = [batch.batch_id for batch in self.book.doubtful]
        # The other trainers' versions as read before the marks: a trainer listed past a
        # batch's round had stored its marks of that step by then.
        others = self.peers.versions()
        try:
            marked = await blocking(self.directory.marked_batches, ids)
        except Exception as e:  # a DHT error: look again at the next turn
            log.info("could not read the marks of doubtful batches: %r", e)
            return
        if any(b.batch_id in marked and self.head.version <= b.epoch for b in self.book.doubtful):
            await self.catch_up()  # the peer's weights hold them: take those first
        trained, again = self.book.settle(marked, self.head.version, others)
        for batch in trained:
            # This trainer's weights (version `self.head.version`) hold the peer's step.
            self.book.trained(batch.groups, self.head.version, self.head.lineage.id)
            self.counts["groups_trained_by_peer"] += len(batch.groups)
            log.info(
                "batch %s: a peer stepped with it; %d groups are trained",
                batch.batch_id,
                len(batch.groups),
            )
            self.metrics.write(
                {
                    "event": "trained_by_peer",
                    "batch_id": batch.batch_id,
                    "policy_version": self.head.version,
                    "lineage": self.head.lineage.id,
                    "trained_group_ids": [g.group_id for g in batch.groups],
                }
            )
        for batch in again:
            log.info("batch %s: no peer took it; its groups go back", batch.batch_id)
            self.counts["groups_requeued"] += len(batch.groups)
            self.batch_ready.set()
