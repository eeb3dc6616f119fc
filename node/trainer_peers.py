"""A trainer's view of the other trainers of its policy, kept by its heartbeat.

    heartbeat, every swarm.heartbeat_s:
        this trainer's NodeRecord (`record()`, node/trainer_status.py) ──▶ the DHT directory
        the directory's records ──▶ `others`: the live trainers of this policy (not this
            trainer's own earlier life) ──▶ the step's share of groups (`step_share`) and
            the peers a swarm step waits for (node/swarm.py)
                                ──▶ `connected`: some other node is listed (else training pauses)
                                ──▶ `settled`: every trainer started before this one is listed

The trainer role (node/trainer.py) reads these between steps; its start (node/trainer_lineage.py
`join_or_resume`) fills `others` once before the first heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agentjet import protocol
from agentjet.bridge import blocking
from agentjet.config import Config
from node.dht import node_of
from node.directory import Directory
from node.replay import Replay
from node.rounds import step_share

log = logging.getLogger(__name__)


@dataclass
class Peers:
    """The other live trainers of `policy`, and whether this trainer is in touch with the
    swarm (see the module docstring)."""

    config: Config
    policy: str
    node_id: str
    peer_id: str  # this trainer's DHT peer: a record naming it is its own previous life's
    directory: Directory
    replay: Replay  # its groups_per_step follows this trainer's share of a step
    # Other live trainers' records, by node id, from the last directory read.
    others: dict[str, protocol.NodeRecord] = field(default_factory=dict)
    connected: asyncio.Event = field(default_factory=asyncio.Event)  # another node is listed
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # see `heartbeat`

    def __post_init__(self) -> None:
        self.connected.set()

    def others_in(self, records: list[protocol.NodeRecord]) -> dict[str, protocol.NodeRecord]:
        """Other trainers' records, by node id. A record naming this trainer's own peer id
        is its previous life's (restarted on the same identity before that record
        expired): dead, and never to be dialed."""
        own = f"/p2p/{self.peer_id}"
        return {
            r.node_id: r
            for r in records
            if r.role == "trainer"
            and r.policy == self.policy
            and r.node_id != self.node_id
            and not any(m.endswith(own) for m in r.maddrs)
        }

    def versions(self) -> list[int]:
        """The other trainers' policy versions, as last read."""
        return [r.policy_version for r in self.others.values()]

    def step_share(self) -> int:
        """This trainer's groups for the next step: with the global batch one trainer's
        (swarm.target_batch_size = 0), its share of trainer.groups_per_step among the live
        trainers (node/rounds.py `step_share`)."""
        groups_per_step = self.config.trainer.groups_per_step
        if not self.config.swarm.target_batch_size:
            groups_per_step = step_share(groups_per_step, 1 + len(self.others))
        self.replay.groups_per_step = groups_per_step
        return groups_per_step

    def set_connected(self, connected: bool) -> None:
        if not self.config.swarm.initial_peers or connected == self.connected.is_set():
            return
        if connected:
            log.info("the swarm is reachable again")
            self.connected.set()
        else:
            log.warning("cut off from the swarm (no other node's record): pausing training")
            self.connected.clear()

    async def heartbeat(self, record: Callable[[], protocol.NodeRecord]) -> None:
        """Every swarm.heartbeat_s: store `record()` in the directory, then read the
        directory's records into `others`, `connected` and `settled`."""
        swarm = self.config.swarm
        reads = 0
        unseen_since: float | None = None  # since when no read has held this trainer's record
        while True:
            if not await blocking(self.directory.publish, record()):
                log.warning("could not store this trainer's record in the DHT")
            records = await blocking(self.directory.records_seen_by, self.node_id)
            if not any(r.node_id == self.node_id for r in records):
                # A read to distrust (a DHT lookup that missed), unless it stays so for a
                # record's whole life: through a cut link, reads time out or find nothing,
                # and others no longer see this trainer either.
                unseen_since = unseen_since or time.monotonic()
                if time.monotonic() - unseen_since >= swarm.record_ttl_s:
                    self.set_connected(False)
            else:
                unseen_since = None
                self.others = self.others_in(records)
                self.step_share()  # (what a step waits for follows the live trainers)
                # Another node's record: not one of this process's other policies, whose
                # records its own DHT peer holds even when cut off from the swarm.
                me = node_of(self.node_id)
                self.set_connected(any(node_of(r.node_id) != me for r in records))
                reads += 1
                if reads == 2:
                    # Our record was up for a heartbeat before this read: every trainer
                    # that started before us is listed, and has had time to list us.
                    self.settled.set()
            await asyncio.sleep(swarm.heartbeat_s)
