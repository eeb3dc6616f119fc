"""The swarm's directory in the DHT: each node's NodeRecord under the swarm's key,
refreshed by heartbeat and expiring after `swarm.record_ttl_s`; marks of trained groups and
of trained gradient batches; revocations; checkpoint records.

    node ──heartbeat──▶ Directory.publish ──▶ DHT (run key, subkey = node id, signed)
    any node ◀── Directory.nodes / trained / marked_batches ◀── DHT (each record checked)

"Trained" survives a trainer cut off (or killed) right after a step, before its marks reach
the DHT. The gradients a trainer accumulates between two resets are one batch, with an id
of its own (node/averagers.py `ExactGradientAverager.batch_id`). As each group joins the
batch, the trainer stores in the DHT, in the background, that the batch holds it (an
intent), and the batch id rides along with the trainer's gradient round (hivemind's
all-gather data). After a step, a trainer marks trained the batches of its round's other
peers whose whole gradients it averaged in (node/allreduce.py `RoundResult.contributors`).
A group counts as trained when it is marked itself or when a batch that held it is
(`Directory.trained`), so one peer's marks cover another's lost ones. The same mark tells a
trainer whose round failed on its side only (node/optimizer.py `RoundFailed.sent`) that a
peer stepped with its batch all the same (node/trainer_doubtful.py).

Records read from the DHT are input from strangers: each one is decoded and checked, and a
bad one is skipped and counted; with keys, each value is signed by the node that wrote it
and read only if a member signed it for its key (node/signed_values.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from functools import partial
from typing import Any, NamedTuple

import hivemind
import msgspec
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from agentjet import protocol
from agentjet.config import SwarmConfig
from agentjet.identity import (
    Membership,
    NodeIdentity,
    NodeKeys,
    Revocation,
    encode_revocation,
)
from node.dht import SwarmAuthorizer, start_dht
from node.members import members_key, revoked_key, subkey_values
from node.signed_values import read_value, sign_record, sign_value, verified_record

log = logging.getLogger(__name__)

# A trained group's mark stays in the DHT this long: far longer than any re-send takes.
TRAINED_MARK_TTL_S = 3600.0
# A revocation is stored for this long, and stored again by every node that holds it.
REVOCATION_TTL_S = 30 * 86400.0
# A trainer's binding of its peer id to its certificate lasts this long, renewed every
# heartbeat: a member, not a liveness mark (a heartbeat late under load must not shut a
# trainer out of its swarm's rounds; revocations are read apart from it).
MEMBER_BINDING_S = 120.0
# Longest batch id accepted from a peer or read from the DHT (ours are about 15 characters).
MAX_BATCH_ID_CHARS = 128
# A stopping node waits at most this long to withdraw its directory record.
WITHDRAW_TIMEOUT_S = 3.0


async def _revoke_in_dht(revocation: bytes, _dht: hivemind.DHT, node: Any) -> None:
    """Runs in the DHT's process (`DHT.run_coroutine`): its authorizer refuses the revoked
    node's token from now on. hivemind 1.1.12: `DHTNode.protocol.authorizer`."""
    authorizer = node.protocol.authorizer
    if isinstance(authorizer, SwarmAuthorizer):
        authorizer.membership.revoke(revocation)


class Directory:
    """The swarm's phone book: one short-lived NodeRecord per live node, in the DHT.

    With `keys` (every swarm but a net.insecure one) a node's record is signed by the node
    (identity.SignedRecord) and a record is read only if a member signed it under its own
    name (`node_of`: a trainer serving several policies signs NODE/POLICY as NODE): one
    signed by another node than the one it describes, or by none, is refused and counted
    (`keys.membership.refused`: impersonation, forged, ...) like any other refusal. Marks,
    intents and checkpoint records are signed and read alike (node/signed_values.py)."""

    def __init__(
        self,
        dht: hivemind.DHT,
        config: SwarmConfig,
        keys: NodeKeys | None = None,
        policy: str = "",
    ) -> None:
        """`policy`: the policy a trainer trains ([[policies]]): its checkpoints' key is
        that policy's (the nodes, marks and members keys are the swarm's)."""
        self.dht = dht
        self.keys = keys
        self.initial_peers = list(config.initial_peers)
        self.ttl_s = config.record_ttl_s
        self.key = f"{config.run_id}.agentjet.nodes"
        self.trained_prefix = f"{config.run_id}.agentjet.trained."
        # One key per group (subkeys: the batches that held it) and one per marked batch,
        # like the trained marks: one key with a subkey per group is fetched whole, and
        # would grow with the run.
        self.intent_prefix = f"{config.run_id}.agentjet.intent."
        self.trained_batch_prefix = f"{config.run_id}.agentjet.trained_batch."
        # Each trainer's newest checkpoint (subkey: its peer id), kept past its death.
        self.checkpoints_key = f"{config.run_id}.agentjet.checkpoints" + (
            f".{policy}" if policy else ""
        )
        # Revoked nodes (subkey: the node's name; value: the root's signed revocation).
        self.revoked_key = revoked_key(config.run_id)
        # Trainers' hivemind peer ids, each bound to its node's certificate (subkey: the
        # peer id; value: an encoded identity.PeerBinding): who may average (`MemberGate`).
        self.members_key = members_key(config.run_id)
        self.bad_records = 0

    def publish(self, record: protocol.NodeRecord) -> bool:
        return bool(
            self.dht.store(
                self.key,
                sign_record(self.keys, protocol.encode(record)),
                expiration_time=get_dht_time() + self.ttl_s,
                subkey=record.node_id,
            )
        )

    def withdraw(self, node_id: str) -> None:
        """Replace this node's record by one that expires at once (a clean goodbye); best
        effort, bounded: a stopping node must not hang on a broken DHT."""
        future = self.dht.store(
            self.key,
            sign_record(self.keys, b""),
            expiration_time=get_dht_time() + 0.5,
            subkey=node_id,
            return_future=True,
        )
        try:
            future.result(timeout=WITHDRAW_TIMEOUT_S)
        except Exception as e:  # the record then expires by itself after record_ttl_s
            log.info("could not withdraw %s from the directory: %r", node_id, e)

    def records(self) -> list[protocol.NodeRecord]:
        """Every live node's newest record; malformed ones are skipped and counted."""
        found = self.dht.get(self.key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        records = []
        for subkey, item in found.value.items():
            value = getattr(item, "value", None)
            if self.keys is not None:
                value = verified_record(self.keys.membership, subkey, value)
                if value is None:
                    continue  # refused, counted by the membership
            if value == b"":
                continue  # withdrawn
            try:
                record = protocol.node_record_decoder.decode(value)  # type: ignore[arg-type]
            except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
                self.bad_records += 1
                continue
            if record.node_id != subkey:
                self.bad_records += 1
                continue
            records.append(record)
        return records

    def revoke(self, revocation: Revocation) -> bool:
        """Store a root-signed revocation where every node reads it (`sync_revocations`)."""
        return bool(
            self.dht.store(
                self.revoked_key,
                encode_revocation(revocation),
                expiration_time=get_dht_time() + REVOCATION_TTL_S,
                subkey=revocation.name,
            )
        )

    def declare_member(self, identity: NodeIdentity, peer_id: str) -> bool:
        """Bind this node's hivemind peer id to its certificate where the trainers' averaging
        handlers look (`MemberGate`), for MEMBER_BINDING_S; trainers do it at start, before
        loading state from peers, and at every heartbeat."""
        return bool(
            self.dht.store(
                self.members_key,
                identity.bind_peer(peer_id, time.time() + MEMBER_BINDING_S),
                expiration_time=get_dht_time() + MEMBER_BINDING_S,
                subkey=peer_id,
            )
        )

    def sync_revocations(self, membership: Membership) -> list[str]:
        """Take in the revocations stored in the swarm (each checked against the root: a
        forged one is refused and counted by `membership`), store again those this node
        knows that the DHT lacks (so they outlive the peer that first held them), and
        return the names newly revoked."""
        found = self.dht.get(self.revoked_key, latest=True)
        stored = {k: v for k, v in subkey_values(found).items() if isinstance(k, str)}
        before = dict(membership.revoked)
        for data in stored.values():
            membership.revoke(data)
        for name, revocation in membership.revocations.items():
            if stored.get(name) != encode_revocation(revocation):
                self.revoke(revocation)
        revoked = sorted(name for name, at in membership.revoked.items() if before.get(name) != at)
        for name in revoked:  # the DHT's own process refuses the node's DHT requests too
            encoded = encode_revocation(membership.revocations[name])
            self.dht.run_coroutine(partial(_revoke_in_dht, encoded))
        return revoked

    def records_seen_by(self, node_id: str) -> list[protocol.NodeRecord]:
        """`records()`, read by node `node_id`: one that finds no other node listed (a cut
        link?) pings the swarm's initial peers again first."""
        records = self.records()
        if not any(r.node_id != node_id for r in records):
            self.rejoin()
        return records

    def rejoin(self) -> int:
        """Ping the swarm's initial peers again; returns how many answered. After a cut
        link the DHT does not look for them by itself, and a node would stay alone."""
        if not self.initial_peers:
            return 0
        try:
            return int(self.dht.run_coroutine(partial(_ping_peers, maddrs=self.initial_peers)))
        except Exception as e:  # best effort: the next heartbeat tries again
            log.info("could not ping the swarm's initial peers: %r", e)
            return 0

    def mark_trained(
        self, group_ids: Iterable[str], mark: Mark, batch_ids: Iterable[str] = ()
    ) -> None:
        """Say in the DHT that these groups' gradients are in the weights `mark` names, and
        so are those of every group the batches `batch_ids` hold (`name_batch`)."""
        expires = get_dht_time() + TRAINED_MARK_TTL_S
        keys = [self.trained_prefix + g for g in group_ids]
        keys += [self.trained_batch_prefix + b for b in batch_ids]
        futures = [
            self.dht.store(
                key, sign_value(self.keys, key, list(mark)), expiration_time=expires,
                return_future=True,
            )
            for key in keys
        ]  # fmt: skip
        for future in futures:
            future.result()

    def record_checkpoint(self, peer_id: str, mark: Mark) -> None:
        """Say that the trainer `peer_id` saved the weights `mark` names (best effort)."""
        future = self.dht.store(
            self.checkpoints_key,
            sign_value(self.keys, f"{self.checkpoints_key}/{peer_id}", list(mark)),
            expiration_time=get_dht_time() + TRAINED_MARK_TTL_S,
            subkey=peer_id,
            return_future=True,
        )
        try:
            future.result(timeout=WITHDRAW_TIMEOUT_S)
        except Exception as e:  # the next checkpoint says it again
            log.info("could not record the checkpoint in the DHT: %r", e)

    def checkpoints(self) -> dict[str, Mark]:
        """Every trainer's newest checkpoint, by peer id (malformed entries skipped)."""
        found = self.dht.get(self.checkpoints_key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        marks = {
            str(k): read_mark(read_value(self.keys, f"{self.checkpoints_key}/{k}", v))
            for k, v in found.value.items()
        }
        return {k: m for k, m in marks.items() if m is not None}

    def name_batch(self, batch_id: str, group_ids: Iterable[str]) -> list[Any]:
        """Start storing that the gradient batch `batch_id` holds these groups; returns the
        stores' futures (each True once some DHT peer holds it)."""
        expires = get_dht_time() + TRAINED_MARK_TTL_S
        return [
            self.dht.store(
                self.intent_prefix + g,
                sign_value(self.keys, f"{self.intent_prefix}{g}/{batch_id}", True),
                expiration_time=expires,
                subkey=batch_id,
                return_future=True,
            )
            for g in group_ids
        ]

    def trained(
        self, group_ids: Iterable[str], live: list[tuple[protocol.Lineage, int]]
    ) -> dict[str, str | None]:
        """The ones among `group_ids` marked trained by a step that is durable now: a
        live trainer's weights hold it (`durable`; `live`: each live trainer's lineage and
        version). Each comes with the mark that says so: None for the group's own, else
        the id of a marked batch that held it."""
        ids = list(group_ids)
        own = self._marks(self.trained_prefix, ids)
        marks: dict[str, str | None] = {g: None for g, m in own.items() if durable(m, live)}
        rest = [g for g in ids if g not in own]
        futures = [self.dht.get(self.intent_prefix + g, return_future=True) for g in rest]
        intents = {
            g: self._batches_named(g, f.result()) for g, f in zip(rest, futures, strict=True)
        }
        batch_marks = self._marks(self.trained_batch_prefix, sorted(set().union(*intents.values())))
        marked = {b for b, m in batch_marks.items() if durable(m, live)}
        through = trained_through_batches(intents, marked)
        if through:
            log.info("%d groups are trained by a peer's mark of their batch", len(through))
        return marks | {g: min(intents[g] & marked) for g in through}

    def undecided(
        self, group_ids: Iterable[str], live: list[tuple[protocol.Lineage, int]]
    ) -> set[str]:
        """The ones among `group_ids` marked trained by a step no live trainer holds yet,
        though one of that step's own lineage, behind it, is listed: a view of the swarm
        from before its trainers restarted, or a peer catching up. Neither trained nor
        to send again yet (`undecided_mark`)."""
        marks = self._marks(self.trained_prefix, list(group_ids))
        return {g for g, m in marks.items() if undecided_mark(m, live)}

    def marked_batches(self, batch_ids: Iterable[str]) -> set[str]:
        """The ones among `batch_ids` some trainer has marked trained."""
        return set(self._marks(self.trained_batch_prefix, list(batch_ids)))

    def _marks(self, prefix: str, names: list[str]) -> dict[str, Mark]:
        """The names whose key `prefix + name` holds a well-formed mark, with it."""
        futures = [self.dht.get(prefix + n, return_future=True) for n in names]
        found = {
            n: read_mark(read_value(self.keys, prefix + n, f.result()))
            for n, f in zip(names, futures, strict=True)
        }
        return {n: m for n, m in found.items() if m is not None}

    def _batches_named(self, group_id: str, found: Any) -> set[str]:
        """`batches_named`, of the batches whose intent a member signed for this group."""
        named = batches_named(found)
        if self.keys is None:
            return named
        key = self.intent_prefix + group_id
        return {b for b in named if read_value(self.keys, f"{key}/{b}", found.value[b]) is True}


class Mark(NamedTuple):
    """A trained mark's value in the DHT: the step's weights, as lineage and version."""

    lineage: str
    version: int


def read_mark(found: Any) -> Mark | None:
    """A DHT value (or what the DHT returned) as a Mark; None when absent or malformed
    (any peer can store values)."""
    value = getattr(found, "value", found)
    if (
        isinstance(value, list | tuple)
        and len(value) == 2
        and isinstance(value[0], str)
        and len(value[0]) <= MAX_BATCH_ID_CHARS
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
    ):
        return Mark(value[0], value[1])
    return None


def undecided_mark(mark: Mark, live: list[tuple[protocol.Lineage, int]]) -> bool:
    """Whether the live trainers can neither confirm a mark (`durable`) nor rule it out:
    a trainer of the mark's own lineage is listed behind its version."""
    return not durable(mark, live) and any(
        lineage.id == mark.lineage and newest < mark.version for lineage, newest in live
    )


def durable(mark: Mark, live: Iterable[tuple[protocol.Lineage, int]]) -> bool:
    """Whether the step a mark names lives on in a live trainer: one whose lineage
    history, up to its current version, holds those weights. Marks are written at the
    step; this is how they are read, so a mark of a step that died with the last trainer
    that held it (never checkpointed, or its checkpoint older) says nothing."""
    return any(lineage.holds(mark.lineage, mark.version, newest) for lineage, newest in live)


def is_batch_id(value: object) -> bool:
    """Whether `value` (a peer's all-gather data, a DHT subkey) can be a batch id."""
    return isinstance(value, str) and 0 < len(value) <= MAX_BATCH_ID_CHARS


def batches_named(found: Any) -> set[str]:
    """The batch ids of a group's intent read from the DHT (None when there is none);
    anything else a stranger stored there is ignored."""
    value = getattr(found, "value", None)
    if not isinstance(value, dict):
        return set()
    return {b for b in value if is_batch_id(b)}


def trained_through_batches(intents: dict[str, set[str]], marked: set[str]) -> set[str]:
    """The groups some batch of which is marked trained: `intents` maps a group to the
    batches that held it, `marked` holds the batches marked trained."""
    return {g for g, batches in intents.items() if batches & marked}


async def _ping_peers(dht: hivemind.DHT, node: Any, maddrs: list[str]) -> int:
    """Runs inside the DHT's process: ping each peer (which puts it back in the routing
    table when it answers)."""

    from hivemind.utils.multiaddr import Multiaddr

    peers = [PeerID.from_base58(Multiaddr(m)["p2p"]) for m in maddrs]
    answers = await asyncio.gather(
        *(node.protocol.call_ping(p) for p in peers), return_exceptions=True
    )
    return sum(1 for a in answers if a is not None and not isinstance(a, BaseException))


def read_directory(config: SwarmConfig, keys: NodeKeys | None) -> list[protocol.NodeRecord]:
    """Join the swarm as a client for a moment and read every live node's record."""
    dht = start_dht(config, keys, client_mode=True)
    try:
        return Directory(dht, config, keys).records()
    finally:
        dht.shutdown()
