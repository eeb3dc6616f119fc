"""The policy versions a trainer serves, and its sealed endpoint: chunks without CURVE.

    trainer ──publish(snapshot), after each step──▶ Publisher: the newest and the one before
    PolicyQuery         ──▶ info(): the newest version with its manifest (node/weights.py;
                            with the swarm's keys also its key, its ticket and the sealed
                            endpoint; where a node on this host maps it; its delta's
                            manifest, node/delta.py), or without (PolicyQuery.manifest
                            false: a poll)
    WeightChunkRequest  ──▶ chunk(): plain, or sealed with keys; of the version's delta
                            when it names the delta's base
    sealed endpoint     a ROUTER without CURVE (with keys only): Hello, and
                        WeightChunkRequest carrying its version's ticket; nothing else

Two versions, so that a fetch one step overtook still finishes (one that two steps
overtook is told "gone" and starts again on the newest). The older one is let go before
the next is made (`retire`), not after, so a trainer holds two versions at most, not three
(513 MB less for SmolLM2-135M at its peak); its fetches lose the ~1 s the next one takes.
Unless a fetch of it is under way (chunks asked within PREVIOUS_IDLE_S): over a slow link
a whole version takes longer than steps do, so the version being fetched stays, the next
one is made beside it (three versions, then), and when it is published the older one
that nobody fetches goes instead. A link so slow that one chunk takes longer than
PREVIOUS_IDLE_S (under ~8 Mbit/s at 2 MiB chunks) looks idle: smaller
net.weight_chunk_bytes there.
It goes earlier too, before a step, when nobody asked for a chunk of it for `idle_s`
(`retire_idle`): rollout nodes fetch a version as soon as it is announced, so through most
steps the trainer holds one version, not two. A fetch that is going on asks for chunks
all the time (several in flight), and keeps it.

Why a socket without CURVE: CURVE encrypts every byte as it is sent (~230 MB/s on a
2-core box, 2.3 s per SmolLM2-135M version per rollout node); a sealed chunk is
encrypted once for all who ask for it at about the same time (the last few are kept), and
relays (node/relay.py) pass chunks on, so the trainer seals each about once per version.
What CURVE still carries is what makes the chunks readable and trusted: the key, and the
hashes each chunk is checked against. Someone who reaches the sealed endpoint without a
ticket gets nothing; with one (a member gave it away) they get ciphertext.
"""

from __future__ import annotations

import hmac
import math
import os
import time
from collections.abc import Callable

from agentjet import protocol
from agentjet.transport import Server
from node import delta as deltas
from node.weights import PolicySnapshot, this_host

# The version before the newest goes before a step once no chunk of it was asked for this
# long: a fetch under way keeps several requests in flight (node/trainer_link.py).
PREVIOUS_IDLE_S = 2.0
# Deltas kept, the newest version's and those before it (node/delta.py): ~9 MB each for a
# bfloat16 SmolLM2-135M, and never more than the version weighs (`_keep_chain`).
DELTA_CHAIN = 8


def sealed_bind_endpoint(trainer_endpoint: str, port: int = 0) -> str:
    """Where the sealed endpoint binds: beside the trainer's socket, on `port` (0: any free
    one; net.sealed_port)."""
    if trainer_endpoint.startswith("ipc://"):
        return trainer_endpoint + ".sealed"
    host = trainer_endpoint.rpartition(":")[0]
    return f"{host}:{port or '*'}"


def announced(bound: str, trainer_announced: str) -> str:
    """The sealed endpoint as peers reach it: the trainer's announced host, its own port."""
    if bound.startswith("ipc://"):
        return bound
    return f"{trainer_announced.rpartition(':')[0]}:{bound.rpartition(':')[2]}"


class Publisher:
    def __init__(
        self,
        first: PolicySnapshot,
        run_id: str,
        sealed: Server | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.published = first
        self.previous: PolicySnapshot | None = None
        # Deltas of the newest version and the versions before it (node/delta.py), by the
        # version each makes: a chain (`chain`).
        self.deltas: dict[int, PolicySnapshot] = {}
        # Whether a chunk was ever asked for on a socket (a node that maps versions asks
        # none): then versions are worth a delta (node/trainer_versions.py).
        self.fetched_over_wire = False
        self.clock = clock
        self.asked: dict[int, float] = {}  # when a chunk of each version was last asked for
        self.previous_since = 0.0  # when `previous` became the version before the newest
        self.run_id = run_id
        self.sealed = sealed  # with the swarm's keys
        self.sealed_endpoint = ""  # as announced (`announce`)
        self.sealed_served = 0  # chunks sent on the sealed endpoint
        self.sealed_refused = 0  # requests refused there

    def announce(self, trainer_announced: str) -> None:
        if self.sealed is not None:
            self.sealed_endpoint = announced(self.sealed.endpoint, trainer_announced)

    def fetching(self, snap: PolicySnapshot | None, idle_s: float = PREVIOUS_IDLE_S) -> bool:
        """Whether a chunk of `snap` was asked for in the last `idle_s` (its delta's chunks
        do not count: they do not need it held): a fetch of it is under way (it keeps
        several requests in flight)."""
        if snap is None:
            return False
        return self.clock() - self.asked.get(snap.version, -math.inf) < idle_s

    def retire(self) -> None:
        """Before making the next version: let the version before the newest go, unless a
        fetch of it is under way. (A whole version over a slow link can take longer than
        steps do, and a fetch two steps overtook would start again, and again; meanwhile
        the trainer holds three versions, the next one made.)"""
        if not self.fetching(self.previous):
            self._keep(None)

    def retire_idle(self, idle_s: float = PREVIOUS_IDLE_S) -> bool:
        """Let the version before the newest go if no chunk of it was asked for in the
        last `idle_s` (counted from its successor's publication); True if it went."""
        if self.previous is None or self.fetching(self.previous, idle_s):
            return False
        if self.clock() - self.previous_since < idle_s:  # a fetch of it may be under way
            return False
        self._keep(None)
        return True

    def publish(self, snap: PolicySnapshot, delta: PolicySnapshot | None = None) -> None:
        """Serve `snap` as the newest version, and `delta` (its delta from the version
        served so far) beside it. One older version stays: the one before it, or the one
        before that while a fetch of that one is under way and none of this one."""
        older = self.published
        if self.previous is not None and self.fetching(self.previous) and not self.fetching(older):
            older = self.previous
        else:
            self.previous_since = self.clock()
        self.published = snap
        self._keep(older)
        if delta is not None:
            self.deltas[snap.version] = delta
        self._keep_chain()

    def _keep(self, older: PolicySnapshot | None) -> None:
        """Serve `older` beside the newest version (None: none), and nothing else."""
        self.previous = older
        served = {self.published.version} | ({older.version} if older is not None else set())
        self.asked = {v: t for v, t in self.asked.items() if v in served}

    def chain(self) -> list[PolicySnapshot]:
        """The deltas that make the newest version, oldest first: its own delta, the
        delta of the version it changes, and so on while one is held."""
        chain: list[PolicySnapshot] = []
        delta = self.deltas.get(self.published.version)
        while delta is not None and len(chain) < len(self.deltas):
            chain.append(delta)
            delta = self.deltas.get(delta.base)
        return chain[::-1]

    def _keep_chain(self) -> None:
        """Keep the newest DELTA_CHAIN deltas of the chain while they weigh less than the
        version itself together (beyond that, fetching the version whole is cheaper): a
        node that missed a few versions fetches their deltas in a row, not the version
        whole (over 20 Mbit/s a whole bfloat16 SmolLM2-135M takes as long as ~5 steps)."""
        kept: dict[int, PolicySnapshot] = {}
        total = 0
        for delta in reversed(self.chain()):
            total += delta.nbytes
            if total > self.published.nbytes or len(kept) == DELTA_CHAIN:
                break
            kept[delta.version] = delta
        self.deltas = kept

    def info(self, lineage: protocol.Lineage, manifest: bool = True) -> protocol.PolicyInfo:
        """The newest version; without `manifest`, only what tells it from others (no chunk
        hashes, key or ticket: what a poll for a newer version needs)."""
        snap = self.published
        info = protocol.PolicyInfo(
            version=snap.version,
            nbytes=snap.nbytes,
            sha256=snap.sha256,
            num_chunks=snap.num_chunks,
            lineage=lineage,
            chunk_bytes=snap.chunk_bytes,
        )
        if manifest:
            info.chunk_hashes = list(snap.hashes)
            info.key, info.ticket = snap.key, snap.ticket
            info.sealed_endpoint = self.sealed_endpoint if snap.key else ""
            if snap.fd >= 0 and this_host():
                info.local = protocol.LocalCopy(host=this_host(), pid=os.getpid(), fd=snap.fd)
            info.deltas = [deltas.manifest(delta) for delta in self.chain()]
        return info

    def chunk(
        self, request: protocol.WeightChunkRequest, sealed: bool = False
    ) -> protocol.WeightChunk | protocol.Error:
        """The chunk `request` asks for (of its version, or of the version's delta from
        `request.base`); on the sealed endpoint (`sealed`) only a sealed one, and only for
        its version's ticket."""
        held = [s for s in (self.published, self.previous) if s is not None]
        if request.base >= 0:
            held = [d for d in (self.deltas.get(request.version),) if d is not None]
        for snap in held:
            if snap.version != request.version or snap.base != request.base:
                continue
            if sealed and not (snap.key and hmac.compare_digest(request.ticket, snap.ticket)):
                return protocol.Error(code="invalid", message="no such ticket")
            if not 0 <= request.index < snap.num_chunks:
                return protocol.Error(code="invalid", message=f"no chunk {request.index}")
            data = snap.chunk(request.index)
            self.fetched_over_wire = True
            if request.base < 0:  # (a delta's chunks do not need its version held)
                self.asked[snap.version] = self.clock()
            return protocol.WeightChunk(
                version=snap.version, index=request.index, data=data, base=request.base
            )
        return protocol.Error(code="gone", message=f"policy version {request.version} is gone")

    async def serve_sealed(self) -> None:
        """Answer the sealed endpoint until cancelled."""
        assert self.sealed is not None
        while True:
            envelope, msg = await self.sealed.recv()
            reply: protocol.TrainerReply
            match msg:
                case protocol.Hello():
                    reply = protocol.answer_hello(msg, self.run_id, self.published.version)
                case protocol.WeightChunkRequest():
                    reply = self.chunk(msg, sealed=True)
                case _:
                    reply = protocol.Error(code="unknown", message="this endpoint serves chunks")
            if isinstance(reply, protocol.WeightChunk):
                self.sealed_served += 1
            elif isinstance(reply, protocol.Error) and reply.code != "gone":
                self.sealed_refused += 1
            await self.sealed.reply(envelope, reply)
