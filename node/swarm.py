"""The swarm's DHT, its directory of nodes, and `hivemind.Optimizer` for the trainers
(with node/allreduce.py, the only modules that import hivemind).

    start_dht(config) ──▶ hivemind.DHT (joins `initial_peers`, retried with backoff)
        ├── Directory: each node's NodeRecord under the swarm's key, refreshed by heartbeat,
        │              expiring after record_ttl_s; marks of trained group ids, and of
        │              trained gradient batches (below)
        └── SwarmOptimizer: learner grads ──step(samples)──▶ averaged with the other
                            trainers ──▶ AdamW; the epoch (= policy version) advances when
                            the swarm's target batch is reached; a lone peer advances at once.
                            Every round is exact (node/allreduce.py): all trainers get the
                            same averaged bits, so one version is one set of weights.

With keys every DHT request and reply is signed and checked (`SwarmAuthorizer`: a node's
certificate is its access token), so a peer without a current, unrevoked certificate cannot
join the DHT, read the directory or store in it; revocations travel through the DHT itself
(`Directory.sync_revocations`). hivemind's averaging and state-download calls are not
covered by its authorizer: the averagers answer only members whose peer id is bound to
their certificate in the DHT (`MemberGate`, `_MembersOnly`).

Local mode uses this exact path with a single peer, so the swarm code is always exercised.

"Trained" survives a trainer cut off (or killed) right after a step, before its marks reach
the DHT. The gradients a trainer accumulates between two resets are one batch, with an id
of its own (`_ExactGradientAverager.batch_id`). As each group joins the batch, the trainer
stores in the DHT, in the background, that the batch holds it (an intent), and the batch
id rides along with the trainer's gradient round (hivemind's all-gather data). After a
step, a trainer marks trained the batches of its round's other peers whose whole
gradients it averaged in (node/allreduce.py `RoundResult.contributors`). A group counts
as trained when it is marked itself or when a batch that held it is (`Directory.trained`),
so one peer's marks cover another's lost ones. The same mark tells a trainer whose round
failed on its side only (`RoundFailed.sent`: it gave up waiting, or a reducer failed it)
that a peer stepped with its batch all the same (node/trainer.py, doubtful batches).

Lessons from DESIGN.md §8 live here: request_timeout passed to the gradient averager too,
explicit ordered shutdown (optimizer, then DHT) so no `p2pd` is orphaned, and hivemind's
own logging kept quiet. Records read from the DHT are input from strangers: each one is
decoded and checked, and a bad one is skipped and counted.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import copy
import logging
import os
import signal
import threading
import time
import traceback
import typing
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, NamedTuple

# hivemind shares tensors between its processes through files in /dev/shm by default;
# a process killed with SIGKILL leaves them there, in memory, until reboot. File
# descriptors die with the process. (Read by hivemind when it is first imported.)
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

import hivemind  # noqa: E402
import msgspec
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import Float16Compression, NoCompression
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.logging import use_hivemind_log_handler
from hivemind.utils.timed_storage import get_dht_time

from agentjet import protocol
from agentjet.bridge import blocking
from agentjet.config import SwarmConfig
from agentjet.errors import AgentjetError
from agentjet.identity import (
    Membership,
    NodeIdentity,
    NodeKeys,
    Revocation,
    encode_certificate,
    encode_revocation,
    signed_by,
)
from agentjet.logs import RepeatedLog
from node import memory
from node.allreduce import ExactAverager, RoundResult, incomplete
from node.members import MemberGate, members_key, revoked_key, subkey_values
from node.rounds import RoundPace, RoundTrouble

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
# A trainer about to average its gradients waits at most this long for the intents naming
# their groups to be stored (they usually are, long before); then it goes on without.
INTENT_WAIT_S = 1.0
# A stopping node waits at most this long to withdraw its directory record.
WITHDRAW_TIMEOUT_S = 3.0
# Seconds between attempts to start the DHT (doubled each time).
STARTUP_BACKOFF_S = 2.0
# A step waiting on a round or a state download looks this often whether the trainer stops.
STOP_POLL_S = 0.25
# A step waiting for the other trainers' batches reads their progress records this often.
PEER_POLL_S = 0.5
# How long a step waits for hivemind's tracker to read the peers it saw (a DHT read; seconds
# on a busy box).
TRACKER_REFRESH_S = 5.0
# A round's patience for a peer's next part of the tensors is the averaging timeout over
# this (matchmaking, the reduce and the gather each take their part).
ROUND_PARTS = 3
# How long an averager's process may take to start serving (`_MembersOnly.attach`).
ATTACH_TIMEOUT_S = 60.0
# A peer's DHT access token lasts this long and is renewed this long before it expires
# (a token only binds the peer's signing key to the swarm; it costs nothing to renew).
TOKEN_LIFETIME = timedelta(hours=24)
TOKEN_RENEW_BEFORE = timedelta(hours=1)


class SwarmAuthorizer(TokenAuthorizerBase):  # type: ignore[misc]
    """hivemind's DHT authorization (hivemind 1.1.12's `TokenAuthorizerBase`), with node
    certificates as the access tokens.

    hivemind signs each DHT request and reply with the peer's RSA key and sends an access
    token that vouches for that key; a peer answers (and accepts answers) only when the
    token is valid. Here a node's token is its certificate (agentjet/identity.py, base64
    in the token's `username`), its RSA public key and an expiry, signed with the node's
    own Ed25519 key. It is valid while the root signed the certificate, the certificate is
    current and not revoked (`membership`, in the DHT's process: `Directory.sync_revocations`
    hands it each revocation the node learns), and the node's key made the signature. So
    only a node with a current certificate reaches the DHT, and a revoked node loses it at
    the next heartbeat of each peer it talks to. hivemind also rejects requests more than a
    minute old by the wall clock, so the peers' clocks must agree to within a minute.

    hivemind's DHT is a forked process: the authorizer, with the node's keys, is inherited,
    never pickled.
    """

    def __init__(self, keys: NodeKeys) -> None:
        super().__init__()
        self.identity = keys.identity
        self.membership = Membership(keys.membership.root_public)
        for revocation in keys.membership.revocations.values():
            self.membership.revoke(revocation)
        self._certificate = base64.b64encode(encode_certificate(keys.identity.certificate))

    @staticmethod
    def _signed(token: AccessToken) -> bytes:
        return b"\0".join(
            [token.username.encode(), token.public_key, token.expiration_time.encode()]
        )

    async def get_token(self) -> AccessToken:
        expires = min(
            datetime.now(UTC) + TOKEN_LIFETIME,
            datetime.fromtimestamp(self.identity.certificate.expires_at, UTC),
        )
        token = AccessToken(
            username=self._certificate.decode(),
            public_key=self.local_public_key.to_bytes(),
            expiration_time=expires.isoformat(),
        )
        token.signature = self.identity.sign(self._signed(token))
        return token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        expires = _expiry(access_token)
        if expires is None or expires <= datetime.now(UTC):
            return False
        try:
            presented = base64.b64decode(access_token.username, validate=True)
        except (ValueError, binascii.Error):
            presented = b""
        certificate = self.membership.admit(presented)
        return certificate is not None and signed_by(
            certificate, self._signed(access_token), access_token.signature
        )

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        expires = _expiry(access_token)
        return expires is None or expires < datetime.now(UTC) + TOKEN_RENEW_BEFORE


async def _revoke_in_dht(revocation: bytes, _dht: hivemind.DHT, node: Any) -> None:
    """Runs in the DHT's process (`DHT.run_coroutine`): its authorizer refuses the revoked
    node's token from now on. hivemind 1.1.12: `DHTNode.protocol.authorizer`."""
    authorizer = node.protocol.authorizer
    if isinstance(authorizer, SwarmAuthorizer):
        authorizer.membership.revoke(revocation)


def _expiry(token: AccessToken) -> datetime | None:
    try:
        expires = datetime.fromisoformat(token.expiration_time)
    except ValueError:
        return None
    return expires if expires.tzinfo is not None else None


# hivemind's ERROR logs (with tracebacks) of conditions a swarm expects: a peer gone, a
# record that outlived its node. Checked against hivemind 1.1.12's messages.
EXPECTED_SWARM_ERRORS = (
    "Failed to download state from",  # averaging/averager.py: a dead peer's record
    "Failed to load state from peer",  # optim/optimizer.py, state_averager.py
    "could not find a group",  # averaging/averager.py: no peer to average with (gone, busy)
    "Unable to run All-Reduce",  # averaging/averager.py: a round broke (RoundFailed says so)
    "dial to self attempted",
    "failed to dial",
    "connection refused",
)


# How hivemind's own waits end when a round or a download is given up or times out. asyncio
# reports each such task nobody retrieved at ERROR, with a traceback ("Task exception was
# never retrieved"): 114 per trainer in a loaded run (issue 47), burying the real messages.
EXPECTED_TASK_ENDS = (asyncio.CancelledError, TimeoutError, concurrent.futures.InvalidStateError)
_task_ends = RepeatedLog(
    log,
    "a hivemind task ended with {detail} (its own wait timed out or was given up; "
    "such ends are counted from now on)",
    "{count} more hivemind tasks ended with a timeout or cancellation in the last "
    "{seconds:.0f} s; the last: {detail}",
)
_task_ends_lock = threading.Lock()  # (records come from hivemind's threads)


def _hivemind_task_end(record: logging.LogRecord) -> BaseException | None:
    """The error of an asyncio record about a hivemind task that ended the expected way,
    else None: a timeout or cancellation, raised in hivemind's code, or of a task named for
    hivemind or of a bare `asyncio.wait_for` (its progress tracker stores its progress in
    such tasks and never awaits them; this project's code awaits every one it makes)."""
    error = record.exc_info[1] if record.exc_info else None
    if record.name != "asyncio" or not isinstance(error, EXPECTED_TASK_ENDS):
        return None
    message = record.getMessage()
    if "/hivemind/" in message or "coro=<wait_for()" in message:
        return error
    cause: BaseException | None = error
    while cause is not None:
        frames = traceback.extract_tb(cause.__traceback__)
        if any("/hivemind/" in frame.filename for frame in frames):
            return error
        cause = cause.__cause__ or cause.__context__
    return None


class ExpectedSwarmErrors(logging.Filter):
    """Turns hivemind's ERROR records of expected swarm conditions into one WARNING line,
    without the traceback; hivemind's tasks that ended in an expected timeout or
    cancellation are counted and logged once per interval (`_task_ends`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ended = _hivemind_task_end(record)
        if ended is not None:
            # Counted once, though each of the root logger's handlers has this filter.
            if not getattr(record, "task_end_counted", False):
                record.task_end_counted = True
                with _task_ends_lock:
                    _task_ends.note(repr(ended))
            return False
        if record.levelno < logging.ERROR or not record.name.startswith("hivemind"):
            return True
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f" ({record.exc_info[1]!r})"
        if any(pattern in text for pattern in EXPECTED_SWARM_ERRORS):
            record.msg, record.args = text.splitlines()[0][:300], None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


def quiet_hivemind() -> None:
    """Route hivemind's logs through ours at WARNING so users see progress, not its noise;
    expected conditions of a swarm come as one WARNING line (`ExpectedSwarmErrors`)."""
    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    # On the handlers: a logger's own filters never see its children's records.
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ExpectedSwarmErrors) for f in handler.filters):
            handler.addFilter(ExpectedSwarmErrors())


def start_dht(
    config: SwarmConfig, keys: NodeKeys | None, *, client_mode: bool = False
) -> hivemind.DHT:
    """Start this node's DHT peer, joining `config.initial_peers`; retried with backoff.

    With `keys` it talks only to peers that hold them (`SwarmAuthorizer`); None only for
    in-process tests and `net.insecure`.

    hivemind's DHT process and p2pd inherit SIGINT ignored: a Ctrl-C in a terminal (sent
    to the whole process group) then reaches only this process, which shuts them down in
    order instead of racing their deaths.
    """
    quiet_hivemind()
    delay = STARTUP_BACKOFF_S
    for attempt in range(1, config.startup_attempts + 1):
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return hivemind.DHT(
                initial_peers=config.initial_peers,
                host_maddrs=config.host_maddrs,
                announce_maddrs=config.announce_maddrs or None,
                identity_path=config.identity_path or None,
                client_mode=client_mode,
                start=True,
                startup_timeout=config.startup_timeout_s,
                authorizer=SwarmAuthorizer(keys) if keys is not None else None,
            )
        except Exception as e:  # hivemind raises several types for "could not start or join"
            where = ", ".join(config.initial_peers) or "a new swarm"
            if attempt == config.startup_attempts:
                raise AgentjetError(
                    f"could not start the swarm's DHT ({where}) after {attempt} attempts: {e}"
                ) from None
            log.warning("DHT start (%s) failed: %s; retrying in %.0f s", where, e, delay)
        finally:
            signal.signal(signal.SIGINT, previous)
        time.sleep(delay)
        delay *= 2
    raise AssertionError("unreachable")


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


def node_of(node_id: str) -> str:
    """The node whose keys sign `node_id`'s record: `node_id` itself, or NODE for the
    NODE/POLICY of a trainer process serving several policies (node/trainer_host.py)."""
    return node_id.partition("/")[0]


class Directory:
    """The swarm's phone book: one short-lived NodeRecord per live node, in the DHT.

    With `keys` (every swarm but a net.insecure one) a node's record is signed by the node
    (identity.SignedRecord) and a record is read only if a member signed it under its own
    name (`node_of`: a trainer serving several policies signs NODE/POLICY as NODE): one
    signed by another node than the one it describes, or by none, is refused and counted
    (`keys.membership.refused`: impersonation, forged, ...) like any other refusal."""

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
                self._signed(protocol.encode(record)),
                expiration_time=get_dht_time() + self.ttl_s,
                subkey=record.node_id,
            )
        )

    def _signed(self, payload: bytes) -> bytes:
        return payload if self.keys is None else self.keys.identity.sign_record(payload)

    def withdraw(self, node_id: str) -> None:
        """Replace this node's record by one that expires at once (a clean goodbye); best
        effort, bounded: a stopping node must not hang on a broken DHT."""
        future = self.dht.store(
            self.key,
            self._signed(b""),
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
                value = self._verified(self.keys.membership, subkey, value)
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

    @staticmethod
    def _verified(membership: Membership, subkey: object, value: object) -> bytes | None:
        """The record `value` stored under `subkey` (a node id) if the member that subkey
        names signed it; else None, the refusal counted by `membership`."""
        signed = membership.signed_record(value)  # type: ignore[arg-type]
        if signed is None:
            return None
        certificate, payload = signed
        if node_of(str(subkey)) != certificate.name:
            membership.refuse(
                "impersonation",
                f"a directory record for {subkey!r} signed by {certificate.name!r}",
            )
            return None
        return payload

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
                key, self._signed_value(key, list(mark)), expiration_time=expires,
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
            self._signed_value(f"{self.checkpoints_key}/{peer_id}", list(mark)),
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
            str(k): read_mark(self._read_value(f"{self.checkpoints_key}/{k}", v))
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
                self._signed_value(f"{self.intent_prefix}{g}/{batch_id}", True),
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
            n: read_mark(self._read_value(prefix + n, f.result()))
            for n, f in zip(names, futures, strict=True)
        }
        return {n: m for n, m in found.items() if m is not None}

    def _batches_named(self, group_id: str, found: Any) -> set[str]:
        """`batches_named`, of the batches whose intent a member signed for this group."""
        named = batches_named(found)
        if self.keys is None:
            return named
        key = self.intent_prefix + group_id
        return {b for b in named if self._read_value(f"{key}/{b}", found.value[b]) is True}

    # Trained marks, batch intents and checkpoint records, like directory records, are
    # signed by the node that writes them (with keys): a value is read only if a member
    # signed it, and signed it for the key (and subkey) it is found under, so a signed mark
    # is not replayed under another group's key. A member is trusted with what it signs:
    # certificates carry no role, so a rollout node's signed mark would count (named by
    # its signature, revocable).

    def _signed_value(self, key: str, value: Any) -> Any:
        """`value` as it is stored under `key`: with keys, an identity.SignedRecord whose
        payload is `[key, value]`."""
        if self.keys is None:
            return value
        return self.keys.identity.sign_record(msgspec.msgpack.encode([key, value]))

    def _read_value(self, key: str, found: Any) -> Any:
        """The value a member stored under `key` (`found`: what the DHT returned, or the
        value itself); None when absent, or refused (counted by the membership)."""
        value = getattr(found, "value", found)
        if self.keys is None or value is None:
            return value
        signed = self.keys.membership.signed_record(value)
        if signed is None:
            return None
        certificate, payload = signed
        try:
            stored_for, inner = msgspec.msgpack.decode(payload)
        except (msgspec.DecodeError, TypeError, ValueError):
            stored_for, inner = None, None
        if stored_for != key:
            self.keys.membership.refuse(
                "forged", f"a value {certificate.name!r} signed for another key, under {key!r}"
            )
            return None
        return inner


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


def round_data(value: object) -> tuple[str | None, int | None]:
    """What a peer sent as its all-gather data in a gradient round: (its batch id, its
    epoch); None for a part that is not one."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        return None, None
    batch_id, epoch = value
    return (
        batch_id if is_batch_id(batch_id) else None,
        epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
    )


def vouched_batches(result: RoundResult) -> tuple[str, ...]:
    """The batch ids of a gradient round's peers whose whole gradients are in this peer's
    result."""
    batches = (round_data(d)[0] for peer, d in result.items() if peer in result.contributors)
    return tuple(sorted(b for b in batches if b is not None))


def round_epochs(result: RoundResult) -> set[int | None]:
    """The epochs the peers of a gradient round said they were at (None: not said)."""
    return {round_data(d)[1] for d in result.values()}


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


class _MembersOnly(DecentralizedAverager):  # type: ignore[misc]
    """hivemind's averaging handlers, answered for members only (`MemberGate`; None: no
    gate, for net.insecure and in-process tests). Checked against hivemind 1.1.12's
    DecentralizedAverager.rpc_join_group, rpc_aggregate_part and rpc_download_state: a
    non-member's join is turned away as if this peer looked for no group, its all-reduce
    stream gets a protocol violation before any part is read, and its state download ends
    empty, as a peer that does not share state answers. (hivemind reads the handlers'
    stream types from `typing.AsyncIterator` hints only: ServicerBase._strip_iterator_hint.)"""

    attached = False  # its process was started (`start`)

    def __init__(
        self,
        *args: Any,
        gate: MemberGate | None = None,
        attach_at_start: bool = True,
        start: bool = True,
        **kwargs: Any,
    ) -> None:
        self.gate = gate
        super().__init__(*args, start=start and attach_at_start, **kwargs)

    def start(self) -> None:
        """Fork the averager's process without the trainer's own tensors (node/memory.py):
        it works on copies in shared memory. Checked against hivemind 1.1.12, where
        DecentralizedAverager is an `mp.Process` started from its constructor (unless
        `attach_at_start` is False: then by `attach`)."""
        with memory.left_behind():
            super().start()
        self.attached = True

    def attach(self, timeout_s: float) -> None:
        """Start the averager's process, if it is not running yet, and wait until it
        serves: it then declares this peer's state for download and joins rounds. Any
        thread may call it: hivemind's `run_in_background` sets a signal handler, which
        only the main thread can (the process ignores SIGINT itself: `run`)."""
        if not self.attached:
            self.start()
            self.wait_until_ready(timeout_s)

    def run(self) -> None:
        """The averager's process: Ctrl-C is for the trainer, which shuts it down. (hivemind
        ignores SIGINT in the parent around the fork instead, which only works from the main
        thread; the process keeps the trainer's handler otherwise.)"""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        super().run()

    @property
    def state_sharing_priority(self) -> float:
        return float(self._state_sharing_priority.value)

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        self._share_with_priority(value)

    def _share_with_priority(self, value: float) -> None:
        """hivemind's setter, which asks the averager's process to declare it again; before
        the process runs it is only kept, and declared when it starts (each message would
        wait in the pipe meanwhile, and a full pipe blocks the trainer)."""
        if self.attached:
            DecentralizedAverager.state_sharing_priority.fset(self, value)
        else:
            self._state_sharing_priority.value = value

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self.gate is not None and not await self.gate.admits(context, "round_joins"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        if self.gate is not None and not await self.gate.admits(context, "aggregate_parts"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        if self.gate is not None and not await self.gate.admits(context, "state_downloads"):
            return
        async for message in super().rpc_download_state(request, context):
            yield message


class _ExactGradientAverager(_MembersOnly, GradientAverager, ExactAverager):  # type: ignore[misc]
    """hivemind's gradient averager, with rounds that leave every trainer the same bits,
    and a batch id for the gradients it accumulates: new at each reset (a step took them,
    or they were thrown away), unique to this process (a restarted trainer, same peer id,
    must not reuse one a peer may have marked). Each gradient round carries it, and the
    trainer's epoch, as its all-gather data (`round_data`). A round is scheduled while the
    gradients accumulate, and every reset comes with the scheduled round triggered,
    cancelled or joined with weight zero.

    Its buffers cost memory only when used (`memory.shared_zeros`, `untouched_zeros`):
    2 x the parameters' size that hivemind writes from the start. The first batch after a
    reset stays in `.grad` (`in_grad`): hivemind would add it to zeroed accumulators, so
    they would hold exactly `.grad`. It is copied into them only if a second batch comes
    before the reset (an epoch of several `step` calls) or `.grad` is cleared meanwhile
    (`materialize`, called by `_Optimizer.zero_grad`), and into the averaged gradients only
    for a round. A trainer whose every step is an epoch never writes the accumulators; a
    lone one never writes the averaged gradients either. For an optimizer not offloaded
    (SwarmOptimizer's). Checked against hivemind 1.1.12's GradientAverager
    (accumulate_grads_, load_accumulators_into_averager_, reset_accumulated_grads_, step)
    and Optimizer (_update_global_epoch, _load_local_gradients_into_optimizer)."""

    # The batch's gradients are still in `.grad`, not copied into the accumulators: one
    # batch since the last reset, so the accumulators would hold them exactly (`in_grad`).
    in_grad = False
    _accumulated = False  # the accumulators were written since they were last zeroed
    _in_round = False  # inside `step`: hivemind loads the gradients into a round

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.process_tag = uuid.uuid4().hex[:12]
        self.batches = 0
        self.epoch: Callable[[], int] = lambda: 0  # the optimizer's, set by _Optimizer
        params = kwargs["parameters"] = tuple(kwargs["parameters"])
        kwargs.setdefault("averaged_grads", tuple(memory.shared_zeros(p) for p in params))
        super().__init__(*args, **kwargs)
        accumulators: tuple[torch.Tensor, ...] | None = self._local_accumulators  # type: ignore[has-type]
        if accumulators is not None and all(a.device.type == "cpu" for a in accumulators):
            self._local_accumulators = memory.untouched_zeros(accumulators)

    @property
    def batch_id(self) -> str:
        return f"{self.process_tag}/{self.batches}"

    def accumulate_grads_(self, batch_size: int) -> None:
        if self.local_times_accumulated == 0 and not self.reuse_grad_buffers:  # type: ignore[has-type]
            # hivemind's bookkeeping, the add into zeroed accumulators left out
            self._anchor_batch_size = batch_size
            self.local_samples_accumulated = batch_size
            self.local_times_accumulated = 1
            self.in_grad = True
            return
        self.materialize()
        self._accumulated = True
        super().accumulate_grads_(batch_size)

    def materialize(self) -> None:
        """Copy gradients left in `.grad` into the accumulators, before `.grad` changes."""
        if self.in_grad:
            for grad, accumulator in zip(
                self._grads_from_parameters(), self._grad_accumulators(), strict=True
            ):
                accumulator.copy_(grad)
            self.in_grad, self._accumulated = False, True

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        """For a round, the batch's gradients into the averaged ones. Without one, into
        `.grad`, where the optimizer (not offloaded) steps: hivemind loads them into the
        averaged gradients then too, and reads those nowhere after (1.1.12: a lone epoch of
        several `step` calls stepped on the last call's gradients alone)."""
        if self._in_round and not self.in_grad:
            super().load_accumulators_into_averager_()
        elif self._in_round:
            with self.get_tensors() as averaged:
                for grad, out in zip(self._grads_from_parameters(), averaged, strict=True):
                    out.copy_(grad)
        elif not self.in_grad:
            scale = 1.0 / self.local_times_accumulated if self.local_times_accumulated else 0.0
            for grad, accumulator in zip(
                self._grads_from_parameters(), self._grad_accumulators(), strict=True
            ):
                grad.copy_(accumulator).mul_(scale)

    def reset_accumulated_grads_(self) -> None:
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._anchor_batch_size = None  # type: ignore[assignment]
        if self._accumulated:  # (zeroing untouched pages would make them exist)
            for accumulator in self._grad_accumulators():
                accumulator.zero_()
        self.in_grad = self._accumulated = False
        self.batches += 1

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_round = True
        try:
            return super().step(*args, **kwargs)
        finally:
            self._in_round = False

    def schedule_step(self, scheduled_time: float | None = None, **kwargs: Any) -> Any:
        if kwargs.get("gather") is None:
            kwargs["gather"] = [self.batch_id, int(self.epoch())]
        return super().schedule_step(scheduled_time, **kwargs)


class _AveragerWatch(ExactAverager):
    """Records what hivemind's TrainingStateAverager only logs: the controls of the
    averaging rounds it begins (`rounds`; a failed parameter round leaves this peer with
    its own parameters) and whether its last state download got a state to load
    (`downloaded`), and a withheld one (`downloaded_own`).

    It sits between TrainingStateAverager and DecentralizedAverager in the bases of
    `_WholeStateAverager`, so TrainingStateAverager's calls to its base pass through here
    (and its parameter rounds are exact, as ExactAverager makes them).
    """

    rounds: tuple[Any, ...] = ()
    downloaded = False
    # The state downloaded was a withheld version: its server's own weights, not the swarm's.
    downloaded_own = False
    # The round a parameter step waits on (hivemind passes one scheduled ahead to `_do`,
    # or begins one there).
    last_round: Any = None
    stopping = threading.Event()  # the trainer's (`_Optimizer.stopping`), set at its stop

    def step(self, *args: Any, **kwargs: Any) -> Any:
        control = super().step(*args, **kwargs)
        if not kwargs.get("wait", True):
            self.rounds = (*self.rounds[-3:], control)
            self.last_round = control
        return control

    def load_state_from_peers(self, timeout: float | None = None) -> Any:
        """hivemind's download, waited for in short turns: a stop gives it up (the state
        averager's `stopping`, set when the trainer stops; RoundAbandoned)."""
        future = super().load_state_from_peers(wait=False, timeout=timeout)
        try:
            state = result_unless_stopping(future, timeout, self.stopping)
        except RoundAbandoned:
            future.cancel()
            raise
        metadata = state[0] if state is not None else {}
        # TrainingStateAverager loads it next, unless the peer's epoch is behind this one's.
        epoch = metadata.get("epoch")
        self.downloaded = isinstance(epoch, int) and epoch >= self.local_epoch
        self.downloaded_own = self.downloaded and metadata.get("withheld") is True
        return state


class _WholeStateAverager(_MembersOnly, TrainingStateAverager, _AveragerWatch):  # type: ignore[misc]
    """Serves this trainer's state copied under the lock each step holds: one version.

    A peer therefore answers a state download only between its steps, and a step lasts
    up to one averaging timeout. hivemind gives each chunk of a download `next_chunk_timeout`
    (one matchmaking time, also its all-reduce patience): a joiner asking a busy trainer
    would nearly always time out. Downloads wait `state_chunk_timeout_s` instead.

    While this trainer is itself downloading state it refuses to serve (two trainers
    downloading from each other would each wait for the other's lock).

    While its version is withheld (`own`: a parameter round failed and no peer sent the
    version's state, so its weights are its own) it serves the state marked `withheld`,
    and ranks it below any other at its epoch (`state_sharing_priority`). A peer takes
    it only when nobody serves better, and then withholds it too: unmarked, such weights
    would pass for the swarm's version, and a peer repairing from them would checkpoint
    them while another held the version's average. Refused instead, they left a swarm
    whose every trainer was withheld with nobody to download from (CI: three trainers
    stuck at one version for minutes). Taken, the trainers hold one weight set, and
    their next step together makes a version that is the swarm's.

    A parameter round averages copies of the parameters (the optimizer is not offloaded:
    `SwarmOptimizer`), which hivemind copies back after the round, even when it stopped
    waiting for the round (its timeout) while the round still runs and writes averaged
    parts into them: the parameters would be a mix of this trainer's own and averaged
    parts, a weight set no other trainer has (seen on a fresh 2-core clone: 6e-4 apart at
    one version). Here only a whole average is copied; otherwise the parameters stay this
    trainer's own and `unapplied` counts it, for `SwarmOptimizer` to take a peer's state
    for that version. Checked against hivemind 1.1.12's TrainingStateAverager._do, step
    and _apply_averaging_results_.
    """

    unapplied = 0

    def __init__(
        self,
        *args: Any,
        step_lock: threading.Lock,
        loading: threading.Event,
        own: threading.Event,
        stopping: threading.Event,
        state_chunk_timeout_s: float,
        **kwargs: Any,
    ) -> None:
        self.stopping = stopping
        self._step_lock = step_lock
        self._loading = loading
        self._own = own
        self._state_chunk_timeout_s = state_chunk_timeout_s
        super().__init__(*args, **kwargs)

    def _make_averaged_parameters(self, main_parameters: Any) -> tuple[torch.Tensor, ...]:
        """The buffers of a parameter round: hivemind fills them with a copy of the
        parameters here, though it copies the parameters in again before each round
        (`_load_local_tensors_into_averager_`) and reads them nowhere else (1.1.12). Zeros
        in untouched shared memory instead: 513 MB for SmolLM2-135M that a trainer without
        peers never pays (node/memory.py)."""
        if self.offload_optimizer or self.reuse_tensors:  # (they are the optimizer's own)
            return super()._make_averaged_parameters(main_parameters)  # type: ignore[no-any-return]
        return tuple(
            memory.shared_zeros(p).requires_grad_(p.requires_grad) for p in main_parameters
        )

    def _do(
        self,
        wait_for_trigger: Any,
        optimizer_step: bool,
        zero_grad: bool,
        averaging_round: bool,
        averaging_control: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        self.last_round = averaging_control  # replaced by `step` if hivemind begins another
        return super()._do(
            wait_for_trigger,
            optimizer_step,
            zero_grad,
            averaging_round,
            averaging_control,
            *args,
            **kwargs,
        )

    def _apply_averaging_results_(self) -> None:
        if not _whole(self.last_round):
            self.unapplied += 1
            log.info("a parameter round had not ended whole: this trainer keeps its own step")
            return
        # Each peer joins a parameter round with the epoch of the state it averages
        # (hivemind gathers it). A trainer that finished its step late can join its
        # peers' round for the next epoch: all would then hold one mix of two versions,
        # which it names the earlier one and they the later (seen on this 2-core box:
        # trainer-b's v8 was trainer-a's v9, bit for bit). Such a round is not applied.
        epochs = set(self.last_round.result().values())
        if epochs != {self.local_epoch}:
            self.unapplied += 1
            log.info(
                "a parameter round mixed peers at epochs %s, this trainer at %d: it keeps "
                "its own step",
                sorted(map(str, epochs)),
                self.local_epoch,
            )
            return
        super()._apply_averaging_results_()

    async def _load_state_from_peers(self, future: Any, timeout: float | None = None) -> None:
        # Runs in the averager's process, never during its own all-reduce (a download runs
        # under the step lock, and so does every round), so the swap is seen by this alone.
        all_reduce_timeout: Any = self.next_chunk_timeout  # type: ignore[has-type]
        self.next_chunk_timeout = self._state_chunk_timeout_s
        try:
            await super()._load_state_from_peers(future, timeout)
        finally:
            self.next_chunk_timeout = all_reduce_timeout

    @property
    def state_sharing_priority(self) -> float:
        return float(self._state_sharing_priority.value)

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        # Peers download from the highest first (hivemind sets the epoch after each step).
        ranked = value - 0.5 if self._own.is_set() else value
        self._share_with_priority(ranked)

    def get_current_state(self) -> Any:
        if self._loading.is_set():
            raise RuntimeError("this trainer is loading the swarm's state itself")
        with self._step_lock:
            metadata, tensors, infos = super().get_current_state()
            metadata["withheld"] = self._own.is_set()
            return metadata, [t.clone() for t in tensors], infos


class _Tracker(ProgressTracker):  # type: ignore[misc]
    """hivemind's progress tracker, with its event loop left clean when it stops.

    hivemind 1.1.12's `ProgressTracker._progress_fetcher` returns at shutdown without
    cancelling a DHT read still in flight (and `run` never closes its loop), so a trainer
    that stopped while its tracker was reading ended with asyncio's "Task was destroyed but
    it is pending!" at ERROR when the loop was collected (test_durable, in CI). Same `run`,
    then what is left on the loop is cancelled and awaited, and the loop closed.
    """

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(
                asyncio.gather(self._progress_reporter(), self._progress_fetcher())
            )
        finally:
            try:
                leftovers = asyncio.all_tasks(loop)
                for task in leftovers:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            finally:
                loop.close()
                self.shutdown_complete.set()


class _Optimizer(hivemind.Optimizer):  # type: ignore[misc]
    """hivemind.Optimizer that counts discarded gradients and serves whole versions.

    A peer that finds itself out of sync inside `step()` loads the swarm's state and
    throws away the gradients it had accumulated; so does a step whose gradient round
    failed. The samples behind them were not trained, and the caller must know to train
    them again: `discards` counts both.

    hivemind serves its state to a joining peer from a background thread, reading the
    parameters while a step may be changing them in place (on CPU `.cpu()` is not a copy),
    so the joiner could get weights of no version at all. Here the state is copied under
    `step_lock`, which `SwarmOptimizer` holds for the whole of each step.
    """

    discards = 0
    reloads = 0  # state downloads: the part of `discards` that cost the whole state in bytes
    failed_rounds = 0
    # Rounds hivemind called a success though a reducer failed this peer (RoundResult.missing):
    # gradient rounds count as failed rounds too, parameter rounds as repairs.
    incomplete_rounds = 0
    # Gradient rounds in which a reducer left a sender out midway (RoundResult.partial).
    partial_rounds = 0
    # Gradient rounds entered before the intents naming the batch's groups were stored.
    late_intents = 0

    def __init__(
        self,
        *args: Any,
        other_trainers: Callable[[], int],
        gate: MemberGate | None = None,
        attach_at_start: bool = True,
        **kwargs: Any,
    ) -> None:
        self.gate = gate  # read by _make_state_averager, which hivemind calls in __init__
        self.attach_at_start = attach_at_start  # likewise
        self.step_lock = threading.Lock()  # held by SwarmOptimizer for each whole step
        self.loading = threading.Event()  # set while this trainer downloads the swarm's state
        # Set while this trainer's version is withheld (`StepOutcome.withheld`): the
        # weights are its own, not the swarm's, and peers take them as such. (`hold_own`)
        self.own = threading.Event()
        self._other_trainers = other_trainers
        # A batch id, and the stores of the intents naming that batch's groups.
        self.intents: tuple[str, list[Any]] = ("", [])
        # Peers' batches the last gradient round vouches for (`vouched_batches`).
        self.peer_batches: tuple[str, ...] = ()
        # Set when the trainer stops: a step waiting on a round or a state download gives
        # it up (`RoundAbandoned`) rather than keep the stop waiting.
        self.stopping = threading.Event()
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            # hivemind 1.1.12 starts the progress tracker's thread before it makes the
            # averagers: one that fails (a bad prefix, a port) left that thread running, and
            # the trainer's process hung at exit instead of ending with its error.
            tracker = getattr(self, "tracker", None)
            if tracker is not None:
                tracker.shutdown()
            raise
        self.grad_averager.epoch = lambda: self.local_epoch

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> ProgressTracker:
        """hivemind 1.1.12's own, as `_Tracker` (a loop left clean at shutdown)."""
        return _Tracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        # hivemind binds the serving method at construction: the subclass must be built here.
        return _WholeStateAverager(
            gate=self.gate,
            step_lock=self.step_lock,
            loading=self.loading,
            own=self.own,
            stopping=self.stopping,
            # A peer answers a state download between steps; a step takes up to a
            # matchmaking time and an averaging timeout for each of its two rounds.
            state_chunk_timeout_s=2 * (self.matchmaking_time + self.averaging_timeout),
            attach_at_start=self.attach_at_start,
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    @property
    def attached(self) -> bool:
        """Whether both averagers' processes run (`attach`)."""
        return bool(self.state_averager.attached and self.grad_averager.attached)

    def attach(self) -> None:
        """Start the averagers' processes if they are not running (made with
        `attach_at_start=False`): a trainer alone has no rounds to join and nobody to serve
        its state to, and each process costs 100-200 MB. Call it between steps."""
        if not self.attached:
            log.info("starting hivemind's averagers: another trainer of this run is about")
            for averager in (self.state_averager, self.grad_averager):
                averager.attach(ATTACH_TIMEOUT_S)

    def load_state_from_peers(self, **kwargs: Any) -> None:
        """hivemind calls this inside `step()` when out of sync: the gradients are lost."""
        self.take_swarm_state(**kwargs)
        self.discards += 1

    def _download_state_once(self, **kwargs: Any) -> None:
        """hivemind 1.1.12's `Optimizer.load_state_from_peers`, with one attempt.

        Its loop asks again at once after any error, `BaseException` included, so a Ctrl-C
        while joining (the `SystemExit` a role raises during set-up) was logged as "Failed
        to load state from peers ... retrying" and swallowed, and a timeout was retried
        forever with a traceback each time. Here an error is one line and no state
        (`state_averager.downloaded` stays False: callers ask again, bounded), and a stop
        propagates. The rest is hivemind's (a scheduled gradient round is joined with
        weight zero, the state averager's pending work is waited for, the tracker's epoch
        and the accumulators are reset after), but for the gradient averager's "state":
        hivemind downloads a peer's averaged gradients too, then drops them unread (another
        model's size in bytes and memory on both sides)."""
        scheduled: Any = self.scheduled_grads  # type: ignore[has-type]
        if scheduled is not None and not scheduled.done():
            self._tag_along_with_zero_weight(scheduled)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        with self.tracker.pause_updates():
            try:
                self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
            except Exception as e:  # a timeout, a peer gone: no state this time
                log.info("could not download the swarm's state: %r", e)
                return
            global_epoch = self.tracker.global_epoch
            if global_epoch - 1 <= self.local_epoch < global_epoch:
                self.state_averager.local_epoch = global_epoch
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            self.state_averager.state_sharing_priority = self.local_epoch
            self.grad_averager.reset_accumulated_grads_()
            self.grad_averager.state_sharing_priority = self.local_epoch

    def take_swarm_state(self, **kwargs: Any) -> None:
        """Download the state of the newest peer, serving none meanwhile."""
        self.attach()
        epoch = self.local_epoch
        self.state_averager.downloaded = False
        self.loading.set()
        try:
            self._download_state_once(**kwargs)
        finally:
            self.loading.clear()
        self.reloads += 1
        if self.state_averager.downloaded:
            # The swarm's state, or a peer's withheld version: then withheld here too.
            self.hold_own(self.state_averager.downloaded_own)
        elif self.local_epoch != epoch:
            # hivemind moves a peer one epoch behind to the swarm's epoch even when no
            # peer sent its state: its old weights would be named the new version (seen:
            # 7e-4 apart from the other trainer's at that version). Stay behind instead;
            # the next step tries again.
            log.info("no peer sent its state; staying at version %d", epoch)
            self.set_epoch(epoch)

    def hold_own(self, own: bool) -> None:
        """Say whether this trainer's weights are its own (its version withheld) or the
        swarm's, and rank its state for peers' downloads by it."""
        if own:
            self.own.set()
        else:
            self.own.clear()
        self.state_averager.state_sharing_priority = self.local_epoch

    def set_epoch(self, epoch: int) -> None:
        """Name this trainer's current state `epoch`, to its averagers and the swarm."""
        self.state_averager.local_epoch = epoch
        self.state_averager.state_sharing_priority = epoch
        self.grad_averager.state_sharing_priority = epoch
        self.tracker.report_local_progress(epoch, samples_accumulated=0)
        # Else the tracker keeps its old view for seconds, and steps wait for it.
        self._refresh_progress(timeout=self.matchmaking_time)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """hivemind's, after gradients it counts as accumulated but left in `.grad` are
        copied out (an epoch not ended by this step: `_ExactGradientAverager.in_grad`)."""
        self.grad_averager.materialize()
        super().zero_grad(set_to_none=set_to_none)

    def _load_local_gradients_into_optimizer(self) -> None:
        """A round that did not happen: step on this trainer's own gradients, which
        `_ExactGradientAverager` loads into `.grad` (the optimizer is not offloaded)."""
        assert not self.offload_optimizer
        self.grad_averager.load_accumulators_into_averager_()
        self.grad_averager.notify_used_averaged_gradients()

    def _maybe_schedule_gradient_averaging(self) -> None:
        """hivemind starts matchmaking for the next gradient round ahead of the step, and
        cancels it at the step when its tracker sees no other peer. A round cancelled in
        matchmaking can leave the averager's matchmaking broken for good: seen in a swarm
        test, a trainer that had just joined (its tracker not yet showing the other)
        cancelled one; its averager's matchmaking tasks were destroyed while pending, and
        every round of both trainers after that found no group, for minutes. And a round
        already matched runs on though cancelled (`_begin_averaging_gradients`). Schedule
        only with a peer to meet (a lone trainer, local mode included, has nothing to
        match)."""
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_gradient_averaging()

    def _begin_averaging_gradients(self, grad_scaler: Any) -> bool:
        """hivemind's tracker may not know of a peer yet (it refreshes every few seconds)
        and step alone; the swarm's directory is fresher. With other trainers listed there,
        a step without a round is a failed round.

        Before its gradients go in, the batch's intents must be stored, or a peer could
        vouch for a batch nobody can find the groups of: wait for them, a little."""
        batch_id, stores = self.intents
        if batch_id == self.grad_averager.batch_id and self.tracker.global_progress.num_peers > 1:
            deadline = time.monotonic() + INTENT_WAIT_S
            try:
                stored = [f.result(max(0.0, deadline - time.monotonic())) for f in stores]
            except Exception as e:  # a timeout, or a DHT error
                stored = [repr(e)]
            if not all(s is True for s in stored):
                self.late_intents += 1
                log.info("averaging gradients before the batch's groups are named in the DHT")
        scheduled = self.scheduled_grads
        began = bool(super()._begin_averaging_gradients(grad_scaler))
        others = self._other_trainers()
        if not began and others:
            self.failed_rounds += 1
            # hivemind cancels a round it had scheduled when its tracker sees no other peer,
            # but a round already matched runs on in the averager, this trainer's gradients
            # in it (seen: a peer stepped with them, then the averager found its control
            # cancelled). With one scheduled, a peer may have them.
            raise RoundFailed(
                f"no gradient round formed, but {others} other trainers are live",
                sent=scheduled is not None,
            )
        return began

    def _average_gradients_and_load_into_optimizer(self, control: Any) -> None:
        """hivemind steps with this peer's own gradients when a round with peers fails;
        two peers doing so at once make one epoch name two different weight sets. Here a
        failed round aborts the step instead (RoundFailed): the caller drops the gradients
        (`discard_round`), and their samples are trained again."""
        if control is not None:
            try:
                result = self._wait_for_round(control)
            except BaseException as e:
                # No group found: nothing was sent. Else the round broke on this side, or
                # this trainer gave up waiting for it (it may go on: a round past
                # matchmaking cannot be called off).
                self.failed_rounds += not isinstance(e, RoundAbandoned)
                sent = bool(control.began_allreduce) or not control.done()
                raise RoundFailed(repr(e), sent=sent) from None
            if incomplete(result):
                # A reducer failed this peer: part of its "average" is its own gradients.
                # The peers may have got all of this peer's gradients and stepped.
                self.incomplete_rounds += 1
                self.failed_rounds += 1
                raise RoundFailed(
                    f"{result.missing:.1%} of the average gradient never came", sent=True
                )
            if isinstance(result, RoundResult):
                if result.partial:
                    # A reducer left a sender out from where it stopped: every peer that
                    # got the whole average sees it, and none steps on it.
                    self.partial_rounds += 1
                    self.failed_rounds += 1
                    raise RoundFailed("a peer's gradients are in part of the average only")
                epochs = round_epochs(result)
                if epochs != {self.local_epoch}:
                    # A trainer behind whose tracker had not yet seen the swarm move on:
                    # each would step its own weights and name them its own next version
                    # (seen in bench-identity: one trainer's v1-v3 were the other's v2-v4).
                    self.failed_rounds += 1
                    raise RoundFailed(
                        f"peers at epochs {sorted(map(str, epochs))} in one gradient round, "
                        f"this trainer at {self.local_epoch}"
                    )
                self.peer_batches = vouched_batches(result)
        super()._average_gradients_and_load_into_optimizer(control)

    def _wait_for_round(self, control: Any) -> Any:
        """The round's result, waited for up to the averaging timeout; a stop gives it up
        at once (`result_unless_stopping`). A timeout says where the round stalled."""
        try:
            return result_unless_stopping(control, self.averaging_timeout, self.stopping)
        except TimeoutError:
            if control.done():  # the round's own error
                raise
            stage = control.stage.name.lower().replace("_", " ")
            raise TimeoutError(
                f"no round within {self.averaging_timeout:.0f} s, still {stage}"
            ) from None

    def discard_round(self) -> None:
        """After RoundFailed: forget the round and the gradients; the weights are untouched.

        No state is loaded here. A trainer whose round failed because the other is busy
        loading *its* state would otherwise load in turn, both holding their step locks
        while asking each other for state: neither answers, and it repeats every step
        (seen in CI after a cut link healed). A trainer behind the swarm finds out from
        hivemind's tracker or the directory and catches up at its next step."""
        for name in ("scheduled_grads", "scheduled_state"):
            control = getattr(self, name)
            if control is not None and not control.done():
                control.cancel()
            setattr(self, name, None)
        self.grad_averager.reset_accumulated_grads_()
        self.tracker.report_local_progress(self.local_epoch, samples_accumulated=0)
        self._publish_progress()
        self.discards += 1
        self._refresh_progress(timeout=self.matchmaking_time)

    def _publish_progress(self) -> None:
        """Store this trainer's progress in the DHT now, as hivemind's reporter would.

        That reporter (1.1.12 `ProgressTracker._progress_reporter`, on the tracker's thread)
        publishes a peer's progress only once it has read it with samples > 0. A round
        that fails at once (no peer seen yet) reports 0 samples again before that thread
        runs, and then it never publishes: no tracker counts this trainer, so no round ever
        forms (seen: two trainers in lock step failing a round every 60 ms for minutes).
        The store is waited for (bounded), so the refresh that follows counts this trainer."""
        tracker = self.tracker
        stored = self.dht.store(
            key=tracker.training_progress_key,
            subkey=tracker._local_public_key,
            value=tracker.local_progress.dict(),
            expiration_time=get_dht_time() + tracker.metadata_expiration,
            return_future=True,
        )
        with contextlib.suppress(Exception):  # a timeout or a DHT error: the reporter's turn
            stored.result(timeout=self.matchmaking_time)

    def _refresh_progress(self, timeout: float) -> None:
        """Have hivemind's tracker read the swarm's progress now and wait for it. It reads
        every few seconds; a trainer retrying at once, as a failed round makes it do,
        would find the same stale view (one peer: no round) every time."""
        tracker = self.tracker
        tracker.fetched_global_progress_this_epoch.clear()
        tracker.global_progress.next_fetch_time = 0.0  # wakes the fetcher to read at once
        tracker.global_state_updated.set()
        tracker.fetched_global_progress_this_epoch.wait(timeout)


async def attach_when_peered(swarm: SwarmOptimizer, period_s: float) -> None:
    """A trainer's loop: start hivemind's averagers (made with `attach_at_start=False`)
    once another trainer of its run is about, looked for every `period_s`; then idle, as
    a role's loops do until the role stops. (A step starts them too, if it finds a peer
    first.)"""
    while not swarm.attached:
        if await blocking(swarm.peered):
            await blocking(swarm.attach)
        else:
            await asyncio.sleep(period_s)
    await asyncio.Event().wait()


def _ended(control: Any) -> bool:
    return control is not None and control.done() and not control.cancelled()


def _incomplete(control: Any) -> bool:
    """Whether a hivemind averaging round (StepControl) left this peer without part of the
    average, though hivemind calls it a success (node/allreduce.py `RoundResult.missing`)."""
    return _ended(control) and control.exception() is None and incomplete(control.result())


def _whole(control: Any) -> bool:
    """Whether a round (StepControl) has ended, without error, with the whole average."""
    if not _ended(control) or control.exception() is not None:
        return False
    result = control.result()
    return not isinstance(result, RoundResult) or not (incomplete(result) or result.partial)


def _averaged(control: Any) -> bool:
    """Whether a parameter round ended with this peer holding the whole average of its own
    and at least one other peer's parameters."""
    if not _whole(control):
        return False
    result = control.result()
    return bool(result.contributors) if isinstance(result, RoundResult) else bool(result)


def _failed(control: Any) -> bool:
    """Whether a hivemind averaging round ended in an error, or incomplete."""
    if not _ended(control):
        return False
    return control.exception() is not None or incomplete(control.result())


class RoundAbandoned(Exception):
    """A step gave up the round it waited on because the trainer stops."""


def result_unless_stopping(future: Any, timeout: float | None, stopping: threading.Event) -> Any:
    """A hivemind future's result, waited for in turns of STOP_POLL_S up to `timeout` (None:
    no bound): RoundAbandoned as soon as `stopping` is set, TimeoutError when the time is up
    (or the future's own error)."""
    deadline = time.monotonic() + timeout if timeout is not None else float("inf")
    while True:
        if stopping.is_set():
            raise RoundAbandoned("the trainer is stopping")
        try:
            return future.result(min(STOP_POLL_S, max(0.0, deadline - time.monotonic())))
        except TimeoutError:
            if future.done() or time.monotonic() >= deadline:
                raise


class RoundFailed(Exception):
    """A gradient all-reduce with other trainers failed; the step did not happen here.

    `sent`: the round failed on this side only, as far as this trainer can tell (it gave
    up waiting, or a reducer failed it), so a peer may have stepped with all of its
    gradients. Whether one did is in the DHT: that peer marks the batch trained
    (`Directory.marked_batches`). Otherwise no peer stepped with them: no round formed,
    or every peer of it sees what failed it (peers at two epochs, a partial average)."""

    def __init__(self, reason: str, sent: bool = False) -> None:
        super().__init__(reason)
        self.sent = sent


@dataclass(frozen=True)
class StepOutcome:
    epoch: int
    applied: bool  # the accumulated gradients went into an optimizer step
    discarded: bool  # they were thrown away (a failed round, or this peer was out of sync)
    # When applied after a round with peers: the batches of those peers whose whole
    # gradients were in it (to mark trained: `Directory.mark_trained`).
    peer_batches: tuple[str, ...] = ()
    # When discarded after a round that may have gone on without this trainer
    # (`RoundFailed.sent`): the id of the batch a peer may have stepped with.
    in_doubt: str | None = None
    # This version's weights may be this trainer's own, not the swarm's (its parameter
    # round failed and no peer sent its state): not to checkpoint or publish.
    withheld: bool = False


class SwarmOptimizer:
    def __init__(
        self,
        config: SwarmConfig,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        weight_decay: float,
        target_batch_size: int,
        dht: hivemind.DHT | None = None,
        other_trainers: Callable[[], int] = lambda: 0,
        gate: MemberGate | None = None,
        directory: Directory | None = None,
        attach_at_start: bool = True,
    ) -> None:
        """Train over `dht` (shared with the node's `directory`, which signs the batches'
        intents with the node's keys), or a DHT of its own. `other_trainers()`: how many
        other live trainers the directory lists now. `gate`: who may call this trainer's
        averaging handlers (None: anyone, without keys). `attach_at_start=False`: start
        hivemind's averager processes only once a peer appears (`peered`, `attach`)."""
        self.gate = gate
        self.config = config
        self.other_trainers = other_trainers
        self.owns_dht = dht is None
        self.dht = dht or start_dht(config, keys=None)  # in-process use (tests, bench)
        self.directory = directory or Directory(self.dht, config)
        # Versions re-taken from a peer after this trainer's parameter round failed.
        self.repairs = 0
        # How long a step waits for the other trainers' batches (node/rounds.py), and what
        # this trainer says when its rounds keep failing.
        self.pace = RoundPace(floor_s=config.averaging_timeout_s)
        self.trouble = RoundTrouble()
        self.waits_for_peers = 0  # steps whose peers' batches did not come within the wait
        compression = Float16Compression() if config.grad_compression == "fp16" else NoCompression()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # see start_dht
        try:
            self.optimizer = _Optimizer(
                other_trainers=other_trainers,
                gate=gate,
                attach_at_start=attach_at_start,
                dht=self.dht,
                run_id=config.run_id,
                target_batch_size=target_batch_size,
                optimizer=partial(torch.optim.AdamW, lr=lr, weight_decay=weight_decay),
                params=params,
                matchmaking_time=config.matchmaking_time_s,
                averaging_timeout=config.averaging_timeout_s,
                average_state_every=config.average_state_every,
                # Average parameters inside the step, not in the background after it: the
                # version a step makes is then the averaged one. With exact rounds the
                # trainers' gradients, and so their steps, are already bit-identical; the
                # parameter round re-synchronizes one that missed a step. Adam's moments
                # are not averaged: fed the same averaged gradients they stay identical,
                # and averaging them would triple the bytes.
                delay_state_averaging=False,
                grad_compression=compression,
                averager_opts={"request_timeout": config.request_timeout_s},
                # How long a round waits for a peer's next part of the tensors (hivemind's
                # default, one matchmaking time, failed half the rounds on a busy box: "50%
                # of the average gradient never came", a peer's averager not scheduled
                # for a second).
                next_chunk_timeout=config.averaging_timeout_s / ROUND_PARTS,
                # A whole state download: two of its chunks' timeouts (`_WholeStateAverager`).
                # hivemind's default, 600 s, held a joiner whose download stalled for ten
                # minutes; given up, it asks again (`load_state_from_peers`).
                load_state_timeout=4 * (config.matchmaking_time_s + config.averaging_timeout_s),
                # A dead trainer stops counting as a peer within record_ttl_s (hivemind's
                # default, 60 s, would fail every round with it for a minute).
                tracker_opts={"metadata_expiration": config.record_ttl_s},
                grad_averager_factory=partial(
                    _ExactGradientAverager,
                    request_timeout=config.request_timeout_s,
                    gate=gate,
                    attach_at_start=attach_at_start,
                ),
                # hivemind offloads the optimizer by default, and then averages parameters in
                # place: the averager's process writes each averaged part straight into the
                # optimizer's parameters as it arrives, even after a step stopped waiting for
                # the round, so nothing could keep a broken round's parts out of a version
                # (`_WholeStateAverager` copies only a whole average). Not offloaded, a round
                # averages copies. The optimizer then steps where the model is.
                offload_optimizer=False,
                verbose=False,
            )
        except BaseException:
            if self.owns_dht:
                self.dht.shutdown()
            raise
        finally:
            signal.signal(signal.SIGINT, previous)

    @property
    def epoch(self) -> int:
        """The swarm's optimizer epoch: the policy version of the current weights."""
        return int(self.optimizer.local_epoch)

    def step(self, batch_size: int) -> int:
        """Hand the accumulated `.grad`s of `batch_size` samples to the swarm; returns the epoch."""
        return self.step_outcome(batch_size).epoch

    def name_groups(self, group_ids: Iterable[str]) -> str:
        """Name in the DHT (in the background) the groups whose gradients the next
        `step_outcome` adds, or that add none but are trained with them; returns the id of
        the batch that holds them. Call it before that step."""
        with self.optimizer.step_lock:
            batch_id = str(self.optimizer.grad_averager.batch_id)
            named, stores = self.optimizer.intents
            if named != batch_id:
                stores = []
            stores += self.directory.name_batch(batch_id, group_ids)
            self.optimizer.intents = (batch_id, stores)
            return batch_id

    @property
    def attached(self) -> bool:
        """Whether hivemind's averager processes run: from the start (`attach_at_start`),
        or since this trainer first had a peer."""
        return self.optimizer.attached

    def peered(self) -> bool:
        """Whether another trainer of this run is about (so this one must serve its state
        and join rounds): the directory lists one, hivemind's progress tracker counts one,
        or a peer's state averager is declared in the DHT, as a joining trainer's is before
        it asks for state (a DHT read)."""
        if self._peer_in_view():
            return True
        key = f"{self.optimizer.state_averager.prefix}.all_averagers"
        found = self.dht.get(key, latest=True)
        declared = found.value if found is not None else None
        own = self.dht.peer_id.to_bytes()
        return isinstance(declared, dict) and any(
            peer != own and isinstance(getattr(info, "value", None), (int, float))
            for peer, info in declared.items()
        )

    def _peer_in_view(self) -> bool:
        """`peered` without its DHT read: what the directory and the tracker show now."""
        return self.other_trainers() > 0 or self.optimizer.tracker.global_progress.num_peers > 1

    def attach(self) -> None:
        """Start hivemind's averager processes, if they are not running: between steps."""
        with self.optimizer.step_lock:
            self.optimizer.attach()

    def stop(self) -> None:
        """The trainer stops: a step waiting for peers, a round or a state download gives
        it up now (its gradients are not applied, so its groups are not trained)."""
        self.optimizer.stopping.set()

    @property
    def round_problem(self) -> str:
        """Why this trainer's gradient rounds keep failing ("" while they work)."""
        return self.trouble.problem

    def _announce_batch(self, batch_size: int) -> None:
        """Tell the swarm (hivemind's progress records) that this trainer holds a batch
        for its epoch, before it waits for the others' (`_await_peer_batches`)."""
        optimizer = self.optimizer
        with optimizer.step_lock:
            held = optimizer.grad_averager.local_samples_accumulated + batch_size
            optimizer.tracker.report_local_progress(optimizer.local_epoch, held)
            optimizer._publish_progress()

    def _peer_batches_ready(self) -> int:
        """How many other trainers' progress records say they hold a batch for this
        trainer's epoch (records from the DHT: checked, a bad one skipped)."""
        tracker = self.optimizer.tracker
        found = self.dht.get(tracker.training_progress_key, latest=True)
        entries = found.value if found is not None else None
        if not isinstance(entries, dict):
            return 0
        ready = 0
        for subkey, entry in entries.items():
            progress = getattr(entry, "value", None)
            if subkey == tracker._local_public_key or not isinstance(progress, dict):
                continue
            samples = progress.get("samples_accumulated")
            ready += (
                progress.get("epoch") == self.epoch
                and isinstance(samples, int)
                and samples > 0
                and progress.get("client_mode") is False
            )
        return ready

    def _give_up_batch(self) -> StepOutcome:
        """The batch's gradients thrown away before any round: its groups are not trained."""
        with self.optimizer.step_lock:
            self.optimizer.zero_grad()
            self.optimizer.discards += 1
        return StepOutcome(self.epoch, applied=False, discarded=True, withheld=self.withheld)

    def _await_peer_batches(self) -> bool:
        """Wait, outside the step lock (state downloads go on), until every other live
        trainer holds a batch for this epoch too, up to `pace.wait_s`; False if the
        trainer stops meanwhile. Without it the first trainer with a batch stepped at once,
        found nobody and threw its batch away, and so did the next (issue 47)."""
        wait_s = self.pace.wait_s
        deadline = time.monotonic() + wait_s
        while (others := self.other_trainers()) > 0:
            if self.optimizer.stopping.is_set():
                return False
            ready = self._peer_batches_ready()
            if ready >= others:
                break
            if time.monotonic() >= deadline:
                self.waits_for_peers += 1
                log.info(
                    "%d of %d other trainers hold a batch after %.0f s; trying the round",
                    ready,
                    others,
                    wait_s,
                )
                break
            time.sleep(PEER_POLL_S)
        return True

    def step_outcome(self, batch_size: int) -> StepOutcome:
        """Like `step`, and say whether the gradients were applied, kept or thrown away."""
        self.pace.step_began()
        if self.attached and self.other_trainers() > 0:
            self._announce_batch(batch_size)
            if not self._await_peer_batches():  # stopping: the batch is given up
                return self._give_up_batch()
        with self.optimizer.step_lock:
            if not self.attached and self._peer_in_view():
                self.optimizer.attach()
            # hivemind's tracker reads the swarm's progress every few seconds: have it count
            # the peers whose batches were just seen, or it would step alone.
            if self.other_trainers() > 0:
                self.optimizer._refresh_progress(timeout=TRACKER_REFRESH_S)
            epoch, discards = self.epoch, self.optimizer.discards
            if self.optimizer.tracker.global_epoch > epoch:
                # hivemind would step a peer one epoch behind on its own older weights
                # (and reconcile later); take the swarm's state first instead.
                self.optimizer.load_state_from_peers()
                self.optimizer.zero_grad()
                return StepOutcome(
                    self.epoch, applied=False, discarded=True, withheld=self.withheld
                )
            averager = self.optimizer.state_averager
            unapplied = averager.unapplied
            rounds = [self.optimizer.scheduled_state]
            averager.rounds = ()
            self.optimizer.peer_batches = ()
            batch_id, in_doubt = str(self.optimizer.grad_averager.batch_id), None
            try:
                self.optimizer.step(batch_size=batch_size)
            except RoundFailed as e:
                if self.optimizer.stopping.is_set():
                    log.info("stopping: the step's gradient round is given up")
                else:
                    log.info("gradient round with peers failed (%s); its gradients are dropped", e)
                    warning = self.trouble.failed(str(e))
                    if warning is not None:
                        log.warning(warning)
                self.optimizer.discard_round()
                in_doubt = batch_id if e.sent else None
            self.optimizer.zero_grad()
            rounds += averager.rounds
            self.optimizer.incomplete_rounds += sum(_incomplete(r) for r in rounds)
            if self.epoch > epoch and (
                any(_failed(r) for r in rounds)
                or self._unaveraged(rounds, epoch)
                or averager.unapplied > unapplied
            ):
                # The gradients were averaged, but the parameters were not (or not all of
                # them): hivemind keeps this trainer's own result, which can differ from
                # the others' at this version (by 6e-4 on a fresh clone: a parameter round
                # still running when hivemind stopped waiting for it). A peer whose round
                # succeeded has the version's averaged state: take it (the step counts).
                log.info(
                    "parameter averaging failed at version %d; taking a peer's state", self.epoch
                )
                self.repairs += 1
                self.optimizer.take_swarm_state()
                if not averager.downloaded:
                    # No peer sent its state: this version may be a weight set of this
                    # trainer's own. The caller withholds it (no checkpoint, not published)
                    # until a later step or download brings the swarm's.
                    self.optimizer.hold_own(True)
            elif self.epoch > epoch:  # a new version, the swarm's
                self.optimizer.hold_own(False)
        discarded = self.optimizer.discards > discards
        applied = not discarded and self.epoch > epoch
        if applied and self.optimizer.peer_batches:
            self.trouble.succeeded()
        return StepOutcome(
            self.epoch,
            applied=applied,
            discarded=discarded,
            peer_batches=self.optimizer.peer_batches if applied else (),
            in_doubt=in_doubt,
            withheld=self.withheld,
        )

    def _unaveraged(self, rounds: list[Any], epoch: int) -> bool:
        """Whether a step from `epoch` taken with peers (its gradient round vouched for
        their batches) was due a parameter round that did not end with the average here:
        one that failed, or that hivemind stopped waiting for while it still ran."""
        due = self.epoch % self.optimizer.average_state_every == 0
        with_peers = bool(self.optimizer.peer_batches)
        return self.epoch > epoch and with_peers and due and not any(_averaged(r) for r in rounds)

    def counts(self) -> dict[str, int]:
        """How often rounds went wrong and how the trainer recovered, for metrics."""
        optimizer = self.optimizer
        return {
            "failed_rounds": optimizer.failed_rounds,
            "incomplete_rounds": optimizer.incomplete_rounds,
            "partial_rounds": optimizer.partial_rounds,
            "late_intents": optimizer.late_intents,
            "state_downloads": optimizer.reloads,
            "repairs": self.repairs,
            "waits_for_peers": self.waits_for_peers,
            **(self.gate.counts() if self.gate is not None else {}),
        }

    def refusals(self) -> dict[str, int]:
        """Non-members' averaging calls refused so far, per kind (none without a gate)."""
        return self.gate.refusals() if self.gate is not None else {}

    @property
    def withheld(self) -> bool:
        """Whether the current version's weights may be this trainer's own, not the
        swarm's: not to checkpoint or publish (`StepOutcome.withheld`)."""
        return self.optimizer.own.is_set()

    def load_state_from_peers(
        self, wait_s: float = 0.0, while_true: Callable[[], bool] = lambda: False
    ) -> bool:
        """Take the swarm's current weights, optimizer state and epoch (a joining trainer);
        False if no peer sent its state. It can be a version a peer withholds (`withheld`).
        If none did, ask again every heartbeat for up to `wait_s` while `while_true()` (a
        live trainer is listed: a lone one starts serving once it sees this one,
        `attach_at_start`)."""
        deadline = time.monotonic() + wait_s
        with self.optimizer.step_lock:
            self.optimizer.load_state_from_peers()
            asked = False
            while (
                not self.optimizer.state_averager.downloaded
                and time.monotonic() < deadline
                and not self.optimizer.stopping.is_set()
                and while_true()
            ):
                if not asked:
                    log.info(
                        "no trainer has sent its state yet; asking again for up to %.0f s", wait_s
                    )
                    asked = True
                time.sleep(min(self.config.heartbeat_s, max(0.0, deadline - time.monotonic())))
                self.optimizer.take_swarm_state()
            return bool(self.optimizer.state_averager.downloaded)

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state (AdamW moments), for a checkpoint to resume from."""
        with self.optimizer.step_lock:
            return copy.deepcopy(self.optimizer.state_averager.optimizer.state_dict())

    def restore(self, epoch: int, optimizer_state: dict[str, Any]) -> None:
        """Resume from a checkpoint: its optimizer state, and its version as the epoch (the
        parameters were loaded into the model before this optimizer was made)."""
        with self.optimizer.step_lock:
            self.optimizer.state_averager.optimizer.load_state_dict(optimizer_state)
            self.optimizer.set_epoch(epoch)

    def processes(self) -> dict[str, Any]:
        """The hivemind processes this optimizer works through, by a name for people: its
        DHT and its two averagers (multiprocessing.Process each, children of this process;
        for `agentjet.lifeline.watch_children`: a step would wait forever on a dead one)."""
        found = {
            "hivemind DHT": self.dht,
            "hivemind gradient averager": self.optimizer.grad_averager,
            "hivemind state averager": self.optimizer.state_averager,
        }
        return {name: process for name, process in found.items() if process is not None}

    def shutdown(self) -> None:
        """Optimizer first (says goodbye, stops averagers), then a DHT of its own."""
        for averager in (self.optimizer.grad_averager, self.optimizer.state_averager):
            if averager is not None and (averager.exitcode is not None or not averager.attached):
                # It died (the role stops for that: `processes`), or never started. hivemind
                # would log either as an error, a death with the traceback of the error the
                # role stops on.
                averager.shutdown = lambda: None
        try:
            self.optimizer.shutdown()
        finally:
            if self.owns_dht:
                self.dht.shutdown()
