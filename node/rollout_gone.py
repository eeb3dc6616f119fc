"""The groups of trainers found gone: trained if the swarm directory's durable marks say so,
else offered to the live trainers, or held while nothing can be told yet.

In node/rollout.py's drawing this sits between the discover task (which finds a trainer
gone, node/rollout_peers.py) and the Ledger (which the deliver task offers from).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

from agentjet import protocol
from agentjet.bridge import blocking
from agentjet.metrics import MetricsWriter
from node.delivery import Ledger
from node.directory import Directory
from node.rollout_peers import Peers

log = logging.getLogger(__name__)


def through_batches(trained: dict[str, str | None]) -> dict[str, str]:
    """Of `Directory.trained`'s answer: the groups known trained only from a peer's mark
    of a batch that held them, each with that batch (for the metrics)."""
    return {g: b for g, b in sorted(trained.items()) if b}


class GoneTrainers:
    """Settles the groups held by `peers.departed` against `directory`'s marks; `unsent` is
    set when groups go back to be offered, `counts` are the node's metrics counters."""

    def __init__(
        self,
        peers: Peers,
        ledger: Ledger,
        directory: Directory | None,
        rejoin_wait_s: float,
        metrics: MetricsWriter,
        counts: defaultdict[str, int],
        unsent: asyncio.Event,
    ) -> None:
        self.peers = peers
        self.ledger = ledger
        self.directory = directory
        self.rejoin_wait_s = rejoin_wait_s
        self.metrics = metrics
        self.counts = counts
        self.unsent = unsent

    async def settle(self) -> None:
        """The groups of gone trainers: trained if a durable mark says so (a live trainer's
        weights hold their step), else offered to the live trainers. With no trainer live
        nothing can be told: they wait, held by the gone trainer, until one is. A group whose
        mark a live trainer of the mark's lineage is still behind waits too, for up to
        swarm.rejoin_wait_s: the listed trainer may be dead and the one that holds the step
        restarting (both trainers killed at once), and sending it again would train it twice."""
        if not self.peers.departed or not self.peers.trainers:
            return
        # Marks are read against the trainers that answer now, as they answer: a record can
        # outlive its trainer by record_ttl_s, and when both trainers were killed at once the
        # other's record said it held the step it had died with (the fault suite lost 2
        # groups so). A trainer restarted on the same endpoint answers with its new lineage.
        live_by_policy = await self.peers.answering()
        for trainer_id, (since, policy) in list(self.peers.departed.items()):
            live = live_by_policy.get(policy)
            if not live:
                continue  # no trainer of its policy answers: nothing can be told yet
            await self._settle_one(trainer_id, since, live)

    async def _settle_one(
        self, trainer_id: str, since: float, live: list[tuple[protocol.Lineage, int]]
    ) -> None:
        assert self.directory is not None
        ids = [p.group.group_id for p in self.ledger.held_by(trainer_id)]
        trained = await blocking(self.directory.trained, ids, live) if ids else {}
        waiting: set[str] = set()
        if time.monotonic() - since < self.rejoin_wait_s:
            rest = [g for g in ids if g not in trained]
            waiting = await blocking(self.directory.undecided, rest, live)
        counts = self.ledger.trainer_gone(trainer_id, set(trained), waiting)
        if not waiting:
            del self.peers.departed[trainer_id]
        if not (counts["trained"] or counts["resent"]):
            return
        self.metrics.write(
            {
                "event": "trainer_gone",
                "node_id": trainer_id,
                "trained_group_ids": sorted(trained),
                "trained_through_batches": through_batches(trained),
                "resent": counts["resent"],
                "waiting": counts["waiting"],
            }
        )
        self.counts["groups_trained"] += counts["trained"]
        self.counts["groups_resent_elsewhere"] += counts["resent"]
        log.warning(
            "trainer %s is gone: %d of its groups were trained (durably), %d go to other "
            "trainers, %d wait for its peers' marks to be read",
            trainer_id,
            counts["trained"],
            counts["resent"],
            counts["waiting"],
        )
        self.unsent.set()
