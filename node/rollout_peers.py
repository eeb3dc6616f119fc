"""The rollout node's view of its peers: the trainers it offers groups to and fetches
versions from, their clients, the trainers found gone, the coordinator's client and the
other rollout nodes' relays.

In node/rollout.py's drawing this is what the discover task brings in ("trainers and
coordinator in"), from the swarm directory's records (`apply_trainers`,
`apply_coordinator`) or, without --join, from the config (`add_static_trainer`); the
deliver, sync, report and produce tasks read it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Mapping

from agentjet import protocol
from agentjet.config import Config, is_endpoint
from agentjet.identity import NodeKeys
from agentjet.transport import Client
from node.delivery import TrainerPeer
from node.policy_sync import PolicySync
from node.relay import RelayPeer
from node.trainer_link import answers, probe, trainer_client

log = logging.getLogger(__name__)

# The trainer of a config without --join (there is no directory to name it); with
# [[policies]], "trainer/NAME" is the trainer of policy NAME.
STATIC_TRAINER = "trainer"


class Peers:
    """The trainers and the coordinator this node knows of; `policies`: each policy's
    versions on this node (told a trainer's version, and of a trainer found gone)."""

    def __init__(
        self,
        config: Config,
        hello: protocol.Hello,
        keys: NodeKeys | None,
        policies: Mapping[str, PolicySync],
    ) -> None:
        self.config = config  # (net: the clients; swarm: when a missing trainer is gone)
        self.hello = hello
        self.keys = keys
        self.policies = policies
        self.trainers: dict[str, TrainerPeer] = {}
        self.clients: dict[str, Client] = {}
        # Clients of trainers gone or moved: a request may still be in flight on them, so
        # they are closed at shutdown, not when the trainer leaves.
        self.retired: list[Client] = []
        self.coordinator: Client | None = None
        self.missing_since: dict[str, float] = {}  # trainer id -> when its record vanished
        # Each listed trainer's newest record time (its heartbeat, on its clock): one that
        # failed a policy fetch is asked again after a newer one only (PolicySync).
        self.heartbeats: dict[str, float] = {}
        # Trainers found gone, with the endpoint and heartbeat of their last record: that
        # record, read until it expires (record_ttl_s) or by a read that lags, lists them
        # no more; a newer heartbeat or another endpoint does (restarted, moved).
        self.gone: dict[str, tuple[str, float]] = {}
        # Gone trainers whose groups are not settled yet (no trainer live to read their
        # marks against, or marks undecided), with when each was found gone.
        # (With [[policies]], each with its policy: its groups' marks are read against the
        # live trainers of that policy only, whose weights alone can hold their steps.)
        self.departed: dict[str, tuple[float, str]] = {}
        self.static_trainers: set[str] = set()  # the trainers of a config without --join
        self.relays: list[RelayPeer] = []  # the other rollout nodes' relays

    def connect_coordinator(self, endpoint: str) -> None:
        if self.coordinator is not None:
            self.retired.append(self.coordinator)
        self.coordinator = Client(
            endpoint,
            protocol.coordinator_reply_decoder,
            self.hello,
            self.config.net.max_message_bytes,
            self.config.net.request_timeout_s,
            self.keys,
        )

    def add_trainer(self, trainer: TrainerPeer) -> None:
        self.trainers[trainer.node_id] = trainer
        self.clients[trainer.node_id] = trainer_client(
            trainer.endpoint, self.hello, self.config, self.keys, self.config.net.request_timeout_s
        )

    def add_static_trainer(self, policy: str, endpoint: str) -> None:
        """The trainer of `policy` a config without --join names by its endpoint."""
        node_id = f"{STATIC_TRAINER}/{policy}" if policy else STATIC_TRAINER
        self.static_trainers.add(node_id)
        self.add_trainer(TrainerPeer(node_id, endpoint, policy=policy))

    def address(self, trainer: TrainerPeer) -> str:
        """The trainer id a request names: a trainer from the directory is asked by its node
        id (a trainer restarted on its endpoint is another); the one trainer of a config
        without --join is unnamed."""
        return "" if trainer.node_id in self.static_trainers else trainer.node_id

    def close_clients(self) -> None:
        for client in [*self.clients.values(), *self.retired, self.coordinator]:
            if client is not None:
                client.close()

    def saw_version(self, trainer: TrainerPeer, version: int) -> None:
        trainer.policy_version = max(trainer.policy_version, version)
        sync = self.policies.get(trainer.policy)
        if sync is not None:
            sync.saw(version)

    def live(self, policy: str) -> list[tuple[protocol.Lineage, int]]:
        """Each live trainer's of `policy` lineage and version: what the DHT's marks of that
        policy's groups are read against."""
        return [(t.lineage, t.policy_version) for t in self.trainers.values() if t.policy == policy]

    async def answering(self) -> dict[str, list[tuple[protocol.Lineage, int]]]:
        """Per policy, the lineage and version of each listed trainer that answers now, as
        it answers (a record can outlive its trainer by record_ttl_s; a trainer restarted on
        the same endpoint answers with its new lineage)."""
        trainers = list(self.trainers.values())
        answered = await asyncio.gather(
            *(probe(t.endpoint, self.hello, self.config, self.keys) for t in trainers)
        )
        by_policy: dict[str, list[tuple[protocol.Lineage, int]]] = defaultdict(list)
        for trainer, status in zip(trainers, answered, strict=True):
            if status is not None:
                by_policy[trainer.policy].append((status.lineage, status.policy_version))
        return by_policy

    def apply_trainers(self, records: list[protocol.NodeRecord], now: float) -> list[str]:
        """Add and update trainers from their records; returns the ids of those whose records
        are missing from two reads in a row (gone, unless they still answer)."""
        seen = set()
        for r in records:
            if r.role != "trainer" or r.protocol_version != protocol.PROTOCOL_VERSION:
                continue
            if not is_endpoint(r.endpoint) or r.policy not in self.policies:
                continue  # (a trainer of a policy this node's config does not hold)
            if self.last_of_gone(r):
                continue
            seen.add(r.node_id)
            trainer = self.trainers.get(r.node_id)
            if trainer is None or trainer.endpoint != r.endpoint or trainer.policy != r.policy:
                if trainer is not None:
                    self.retired.append(self.clients.pop(r.node_id))
                policy = f" (policy {r.policy})" if r.policy else ""
                log.info("trainer %s at %s joined%s", r.node_id, r.endpoint, policy)
                trainer = TrainerPeer(r.node_id, r.endpoint, policy=r.policy)
                self.add_trainer(trainer)
                self.heartbeats[r.node_id] = r.time  # (at another endpoint: another clock)
            self.heartbeats[r.node_id] = max(self.heartbeats.get(r.node_id, r.time), r.time)
            trainer.queue, trainer.capacity = max(r.queue, 0), max(r.capacity, 1)
            if trainer.lineage != r.lineage:
                trainer.lineage, trainer.policy_version = r.lineage, r.policy_version
            self.saw_version(trainer, r.policy_version)
        gone = []
        for trainer_id in list(self.trainers):
            if trainer_id in seen:
                self.missing_since.pop(trainer_id, None)
            elif (
                now - self.missing_since.setdefault(trainer_id, now)
                >= self.config.swarm.heartbeat_s
            ):
                # Missing from two reads in a row: its record expired (record_ttl_s silent),
                # or the reads missed it.
                gone.append(trainer_id)
        return gone

    def last_of_gone(self, record: protocol.NodeRecord) -> bool:
        """Whether `record` is (or predates) the last record of a trainer found gone: no newer
        heartbeat, the same endpoint. Else a gone trainer is back, and listed again."""
        gone = self.gone.get(record.node_id)
        if gone is None:
            return False
        endpoint, heard = gone
        if record.endpoint == endpoint and record.time <= heard:
            return True
        del self.gone[record.node_id]
        return False

    async def drop_silent(self, missing: list[str]) -> None:
        """Of the trainers missing from the directory (`apply_trainers`), drop those that do
        not answer either."""
        for trainer_id in missing:
            trainer = self.trainers[trainer_id]
            if await answers(trainer.endpoint, trainer_id, self.hello, self.config, self.keys):
                # A directory read can miss a live peer's record (a partial DHT lookup under
                # load): re-sending its groups would train them twice.
                self.missing_since.pop(trainer_id, None)
                log.info("trainer %s is missing from the directory but answers", trainer_id)
                continue
            self.drop_trainer(trainer_id)

    def drop_trainer(self, trainer_id: str) -> None:
        """Trainer `trainer_id` is gone: nothing is offered to or fetched from it (a fetch
        in flight ends) until a record of it newer than its last, or at another endpoint."""
        trainer = self.trainers.pop(trainer_id)
        self.missing_since.pop(trainer_id, None)
        self.retired.append(self.clients.pop(trainer_id))
        self.departed[trainer_id] = (time.monotonic(), trainer.policy)
        self.gone[trainer_id] = (trainer.endpoint, self.heartbeats.pop(trainer_id, 0.0))
        for sync in self.policies.values():
            sync.forget(trainer_id)

    def apply_coordinator(self, records: list[protocol.NodeRecord]) -> None:
        coordinators = [r for r in records if r.role == "coordinator" and is_endpoint(r.endpoint)]
        if not coordinators:
            return
        newest = max(coordinators, key=lambda r: r.time)
        if self.coordinator is None or self.coordinator.endpoint != newest.endpoint:
            log.info("coordinator at %s", newest.endpoint)
            self.connect_coordinator(newest.endpoint)
