"""Where each of a rollout node's groups is until a trainer has trained it.

    produced ──▶ new ──SubmitGroup──▶ "accepted" / "duplicate" ──▶ held(T) ──GroupStatus──▶ gone
                  ▲        ├─ stale, rejected, zero_variance: gone    │   "trained" / "dropped"
                  │        │ no reply: T may have it                  │
                  │        ▼                                          │ "unknown" (T restarted
                  │     unsure(T): offered again to T only            │  and lost its queue)
                  ├───────────────────────────────────────────────────┘
                  └── T gone (its directory record expired) and no durable trained mark in
                      the DHT (T's own, or a peer's of a gradient batch that held the group,
                      naming weights a live trainer's lineage holds; node/directory.py `durable`)

A group goes to another trainer only when the one that may hold it is gone, so no group is
trained twice by two live trainers; a trainer that dies with groups in its queue loses
none, because the node keeps every group until it is trained. Trainers are picked by
backlog: queued groups over capacity, the trainer's own report or what this node has
handed it, whichever is larger. Bookkeeping, plus the on-disk copy (node/spool.py) each
group has from `add` until it leaves, so a restarted node offers its groups again; the
rollout role does the talking.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal

from agentjet import protocol
from node.spool import Spool

# A trainer that said "busy" or did not answer is left alone this long (doubled
# per further failure, up to RETRY_MAX_S).
RETRY_MIN_S, RETRY_MAX_S = 0.5, 10.0


@dataclass
class TrainerPeer:
    node_id: str
    endpoint: str
    queue: int = 0
    capacity: int = 1
    policy_version: int = 0  # of `lineage`
    lineage: protocol.Lineage = field(default_factory=protocol.Lineage)
    blocked_until: float = 0.0  # monotonic time before which nothing is offered to it
    failures: int = 0
    policy: str = ""  # the policy it trains: it takes only that policy's groups

    def block(self, now: float, backoff: bool) -> None:
        """Leave this trainer alone for a while (longer after each unanswered request)."""
        self.failures = self.failures + 1 if backoff else 0
        self.blocked_until = now + min(RETRY_MIN_S * 2 ** max(self.failures - 1, 0), RETRY_MAX_S)


@dataclass
class Pending:
    group: protocol.TrajectoryGroup
    state: Literal["new", "unsure", "held"] = "new"
    trainer: str | None = None  # the trainer that holds (or may hold) it


@dataclass
class Ledger:
    pending: dict[str, Pending] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)
    spool: Spool | None = None

    def add(
        self, group: protocol.TrajectoryGroup, write: bool = True, holder: str | None = None
    ) -> None:
        """Hold `group` until trained, first writing it to the spool unless `write` is false
        (it came from there); raises SpoolFull, holding nothing, when the spool is at its cap.
        `holder`: a trainer that may hold it (restored from the spool): offered to it only."""
        if self.spool is not None and write:
            self.spool.put(group)
        if holder is None:
            self.pending[group.group_id] = Pending(group)
        else:
            self.pending[group.group_id] = Pending(group, state="unsure", trainer=holder)

    def _forget(self, group_id: str) -> None:
        """The group is done with (trained, dropped or refused for good)."""
        self.pending.pop(group_id, None)
        if self.spool is not None:
            self.spool.remove(group_id)

    def __len__(self) -> int:
        return len(self.pending)

    def unplaced(self, policy: str | None = None) -> int:
        """Groups (of `policy` only, unless None) no trainer has accepted yet: what
        backpressure counts."""
        return sum(
            1
            for p in self.pending.values()
            if p.state != "held" and (policy is None or p.group.policy == policy)
        )

    def to_offer(self) -> list[Pending]:
        return [p for p in self.pending.values() if p.state != "held"]

    def held_by(self, trainer_id: str) -> list[Pending]:
        return [p for p in self.pending.values() if p.trainer == trainer_id]

    def pick(
        self, pending: Pending, trainers: dict[str, TrainerPeer], now: float
    ) -> TrainerPeer | None:
        """The trainer to offer `pending` to now (one of its policy's), or None to wait."""
        if pending.state == "unsure":
            trainer = trainers.get(pending.trainer or "")
            return trainer if trainer is not None and trainer.blocked_until <= now else None
        policy = pending.group.policy
        ready = [t for t in trainers.values() if t.blocked_until <= now and t.policy == policy]
        if not ready:
            return None

        def backlog(t: TrainerPeer) -> float:
            return max(t.queue, len(self.held_by(t.node_id))) / max(t.capacity, 1)

        least = min(backlog(t) for t in ready)
        return self.rng.choice([t for t in ready if backlog(t) == least])

    def offering(self, pending: Pending, trainer: TrainerPeer) -> None:
        """`pending` is about to be sent to `trainer`: its name goes on disk first. A node
        killed before the answer (or after an offer that went unanswered) then offers the
        group to that trainer alone after its restart, which may have queued it (seen in
        the fault suite: offered anywhere again, two trainers trained it in one step)."""
        if self.spool is not None:
            self.spool.hold(pending.group.group_id, trainer.node_id)

    def offered(self, pending: Pending, trainer: TrainerPeer, reply: object, now: float) -> str:
        """Record a trainer's answer to SubmitGroup; returns what happened, for counting."""
        match reply:
            case protocol.GroupAck(status="accepted" | "duplicate" as status):
                pending.state, pending.trainer = "held", trainer.node_id
                trainer.failures = 0
                if self.spool is not None:
                    self.spool.hold(pending.group.group_id, trainer.node_id)
                return status
            case protocol.GroupAck(status=status):  # stale, rejected, zero_variance: final
                self._forget(pending.group.group_id)
                return status
            case protocol.Error(code="busy" as code):
                trainer.block(now, backoff=False)
                if pending.state == "new":
                    pending.trainer = None
                return code
            case protocol.Error(code="gone" as code):
                # Another trainer answers at its endpoint (it was restarted there): the one
                # offered to may hold the group (an earlier offer went unanswered), so the
                # group stays with it until it is settled as a gone trainer's.
                self.unanswered(pending, trainer, now)
                return code
            case _:  # an error reply to a well-formed group: it will not pass later either
                self._forget(pending.group.group_id)
                return "refused"

    def unanswered(self, pending: Pending, trainer: TrainerPeer, now: float) -> None:
        """SubmitGroup got no reply: the trainer may have queued it, so it stays with it."""
        pending.state, pending.trainer = "unsure", trainer.node_id
        trainer.block(now, backoff=True)

    def statuses(self, trainer_id: str, statuses: Mapping[str, str]) -> dict[str, int]:
        """Apply a trainer's GroupStatus; returns counts of trained / dropped / resent."""
        counts = {"trained": 0, "dropped": 0, "resent": 0}
        for group_id, status in statuses.items():
            pending = self.pending.get(group_id)
            if pending is None or pending.trainer != trainer_id:
                continue
            if status in ("trained", "dropped"):
                self._forget(group_id)
                counts[status] += 1
            elif status == "unknown":
                pending.state, pending.trainer = "new", None
                counts["resent"] += 1
        return counts

    def trainer_gone(
        self, trainer_id: str, trained: AbstractSet[str], waiting: AbstractSet[str] = frozenset()
    ) -> dict[str, int]:
        """Its groups: marked trained in the DHT are done, `waiting` ones stay held by it
        (their marks cannot be read yet); the rest go to other trainers."""
        counts = {"trained": 0, "resent": 0, "waiting": 0}
        for pending in self.held_by(trainer_id):
            if pending.group.group_id in trained:
                self._forget(pending.group.group_id)
                counts["trained"] += 1
            elif pending.group.group_id in waiting:
                counts["waiting"] += 1
            else:
                pending.state, pending.trainer = "new", None
                counts["resent"] += 1
        return counts
