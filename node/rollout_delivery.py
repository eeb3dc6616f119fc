"""Delivery to trainers: offer the Ledger's groups, ask trainers which they trained, and the
backpressure that the groups waiting for a trainer put on producing.

In node/rollout.py's drawing this is the deliver task: Ledger ──SubmitGroup──▶ least
backlogged trainer ──GroupAck──▶ held ◀──GroupStatus: trained──. The trainers it reads are
node/rollout_peers.py's; the Ledger is node/delivery.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterable

from agentjet import protocol
from agentjet.logs import RepeatedLog
from agentjet.roles import wait_for
from agentjet.transport import PeerUnavailable
from node.delivery import Ledger, Pending, TrainerPeer
from node.rollout_peers import Peers

log = logging.getLogger(__name__)

# How often the node asks trainers which of the groups they hold are trained.
STATUS_POLL_S = 1.0


class Backpressure:
    """Room for another batch while few groups wait for a trainer and the spool is under its
    cap. `room` is set while there is; the produce loop waits on it."""

    def __init__(self, ledger: Ledger, policies: Iterable[str], max_unacked_groups: int) -> None:
        self.ledger = ledger
        self.policies = list(policies)  # ("": the swarm's one policy)
        self.bound = max_unacked_groups
        self.room = asyncio.Event()
        self.room.set()

    def with_room(self) -> list[str]:
        """The policies with room for another batch: fewer than rollout.max_unacked_groups of
        their groups wait for a trainer (per policy: one whose trainers are all down or
        done must not stop the others), and the spool under its cap."""
        spool = self.ledger.spool
        if spool is not None and spool.full():
            return []
        return [name for name in self.policies if self.ledger.unplaced(name) < self.bound]

    def has_room(self) -> bool:
        """With [[policies]]: while some policy has room."""
        return bool(self.with_room())

    def open_if_room(self) -> None:
        if self.has_room():
            self.room.set()

    def close_if_full(self) -> None:
        """After a batch: no more until trainers take groups, or train spooled ones."""
        if self.has_room():
            return
        self.room.clear()
        spool = self.ledger.spool
        if spool is not None and spool.full():
            log.warning(
                "spool %s is full (%.1f MiB): generating no more until trainers train held groups",
                spool.directory,
                spool.nbytes / 2**20,
            )


class Delivery:
    """Offers `ledger`'s groups to `peers`' trainers and polls the ones they hold; `unsent`
    wakes it when there is something new to offer."""

    def __init__(
        self,
        ledger: Ledger,
        peers: Peers,
        backpressure: Backpressure,
        counts: defaultdict[str, int],
    ) -> None:
        self.ledger = ledger
        self.peers = peers
        self.backpressure = backpressure
        self.counts = counts
        self.unsent = asyncio.Event()
        # A trainer that quarantined this node rejects every group it sends: a line, then
        # counts.
        self.rejected_log = RepeatedLog(
            log,
            "trainer rejected group {detail}",
            "trainers rejected {count} more groups in the last {seconds:.0f} s; the last: {detail}",
            level=logging.ERROR,
        )

    async def run(self) -> None:
        """Offer groups to trainers, and ask the trainers holding groups which are trained."""
        last_poll = 0.0
        while True:
            self.unsent.clear()
            for pending in self.ledger.to_offer():
                trainer = self.ledger.pick(pending, self.peers.trainers, time.monotonic())
                if trainer is not None:
                    await self.offer(pending, trainer)
            if time.monotonic() - last_poll >= STATUS_POLL_S:
                await self.poll_statuses()
                last_poll = time.monotonic()
            self.backpressure.open_if_room()
            with contextlib.suppress(TimeoutError):
                await wait_for(self.unsent.wait(), STATUS_POLL_S)

    async def offer(self, pending: Pending, trainer: TrainerPeer) -> None:
        group_id = pending.group.group_id
        if pending.state == "unsure":
            self.counts["groups_resent"] += 1
        self.ledger.offering(pending, trainer)
        try:
            reply = await self.peers.clients[trainer.node_id].request(
                protocol.SubmitGroup(group=pending.group, trainer_id=self.peers.address(trainer))
            )
        except PeerUnavailable as e:
            self.ledger.unanswered(pending, trainer, time.monotonic())
            log.warning("%s; %d groups wait for a trainer", e, self.ledger.unplaced())
            return
        finally:
            if trainer.node_id not in self.peers.trainers:
                # Found gone while this request was in flight, after its other groups were
                # settled: this one may sit in its queue too (it stays held by it), so it is
                # settled the same way. Left alone it waited for that trainer forever, and a
                # few such groups stopped this node (backpressure) in the fault suite.
                self.peers.departed.setdefault(trainer.node_id, (time.monotonic(), trainer.policy))
        outcome = self.ledger.offered(pending, trainer, reply, time.monotonic())
        self.counts[f"groups_{outcome}"] += 1
        match reply:
            case protocol.GroupAck(policy_version=version):
                self.peers.saw_version(trainer, version)
                if reply.status == "rejected":
                    self.rejected_log.note(f"{group_id}: {reply.reason}")
            case protocol.Error(code="busy"):
                pass
            case protocol.Error(code="gone", message=message):
                log.info("trainer %s was restarted (%s): its groups wait", trainer.node_id, message)
            case protocol.Error(message=message):
                log.error("trainer refused group %s: %s", group_id, message)
            case _:
                log.error("unexpected reply to SubmitGroup: %s", type(reply).__name__)

    async def poll_statuses(self) -> None:
        for trainer_id, trainer in list(self.peers.trainers.items()):
            held = [p.group.group_id for p in self.ledger.held_by(trainer_id) if p.state == "held"]
            if not held or trainer.blocked_until > time.monotonic():
                continue
            client = self.peers.clients.get(trainer_id)
            if client is None:
                continue  # found gone while an earlier trainer was asked
            try:
                reply = await client.request(
                    protocol.GroupStatusQuery(group_ids=held[: protocol.MAX_STATUS_IDS])
                )
            except PeerUnavailable:
                trainer.block(time.monotonic(), backoff=True)
                continue
            if not isinstance(reply, protocol.GroupStatus):
                log.warning("trainer %s answered GroupStatusQuery with %s", trainer_id, reply)
                continue
            self.peers.saw_version(trainer, reply.policy_version)
            for what, count in self.ledger.statuses(trainer_id, reply.statuses).items():
                self.counts[f"groups_{what}"] += count
