"""A policy version spreads through the rollout nodes instead of out of one trainer.

    trainer ──PolicyInfo over CURVE: manifest (chunk hashes), key, ticket──▶ every node
    chunk i has an owner: owners(version, members)[i], members = this node and the relays
    the directory names (rollout records' `endpoint`), in node-id order

    node A ──its own chunks──────────────────▶ trainer (node/trainer_link.py TrainerSource)
           ──chunk i, for each other owner O──▶ O's RelayServer: the chunk as the trainer
                                               serves it; "absent" (not yet: ask again);
                                               "gone" (O holds another version)
           ──what an owner did not give──────▶ trainer: O does not answer, served a chunk
                                               that fails its check, or stalled
                                               (RELAY_STALL_S)

So the trainer sends each chunk about once, whatever the number of nodes, and each node
uploads its share to the others while it fetches the rest. Trust is unchanged by relays:
the manifest and key come from the trainer over CURVE only; a relay carries chunks, and
each is checked against its hash in that manifest (WeightAssembly.add), so a relay that
serves bad bytes costs a retry at the trainer, never a wrong weight. With the swarm's keys
a relay serves chunks sealed as the trainer sealed them (WeightAssembly.served: sealed
again under the version's key, which gives the trainer's very bytes), on a socket without
CURVE, to requests carrying the version's ticket, like the trainer's sealed endpoint
(node/publisher.py). A node holds one version at a time for others: the one it fetches
or fetched last, until its next fetch begins (which may reuse its buffer), or that
version's delta (node/delta.py) when it fetched the delta: it serves what it fetched.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agentjet import protocol
from agentjet.bridge import blocking
from agentjet.config import NetConfig
from agentjet.errors import ProtocolError
from agentjet.roles import wait_for
from agentjet.transport import Client, PeerUnavailable, Server
from node.trainer_link import SEALED_HANDSHAKE_TIMEOUT_S, TrainerSource, plain_client
from node.weights import RecentChunks, WeightAssembly

log = logging.getLogger(__name__)

# A relay that holds no such version (it fetches another, or none) this long into a fetch,
# or one that has the version but gave nothing while no chunk came from anywhere for this
# long, is given up for this fetch: what it owes comes from the trainer. (While chunks come
# from elsewhere, a slow owner costs nothing: this node is busy anyway.)
RELAY_STALL_S = 5.0
# A relay's reply (a chunk) taking longer than this: it is taken for dead.
RELAY_REPLY_TIMEOUT_S = 10.0
# Chunk requests in flight to one relay (it serves every other node at once), and to the
# trainer while relaying: each owner takes few chunks at once, so the trainer's link
# finishes one chunk for each owner early, and owners can pass chunks on from the start.
RELAY_WINDOW = 2
# A request for a chunk the relay does not hold yet waits this long for it (then "absent"),
# at most RELAY_MAX_WAITING at once; waiting ones look every RELAY_WATCH_S.
RELAY_HOLD_S = 2.0
RELAY_MAX_WAITING = 64
RELAY_WATCH_S = 0.005
# Chunks a relay keeps as served (sealed), for the other nodes asking for the same ones.
RELAY_RECENT_CHUNKS = 8
# Chunks asked of a relay in one round (the next ones it owes).
RELAY_ROUND = 4 * RELAY_WINDOW
# "absent" (the owner has not got the chunk yet): ask again after this long, doubled up to
# ABSENT_RETRY_MAX_S while no chunk comes from anywhere.
ABSENT_RETRY_S, ABSENT_RETRY_MAX_S = 0.05, 0.4


@dataclass(frozen=True, order=True)
class RelayPeer:
    node_id: str
    endpoint: str


def owners(version: int, members: Sequence[str], num_chunks: int) -> list[str]:
    """Which member takes each chunk from the trainer first: round robin over the members in
    node-id order, started at an offset that moves with the version (so no node is always
    the one with the version's last, short chunk)."""
    ordered = sorted(set(members))
    return [ordered[(i + version) % len(ordered)] for i in range(num_chunks)]


@dataclass
class FetchStats:
    from_trainer: int = 0
    from_relays: int = 0
    relay_failures: dict[str, str] = field(default_factory=dict)  # relay -> why given up
    nbytes: int = 0  # of what was fetched: the version, or its delta
    delta_base: int = -1  # the version the deltas fetched change (-1: fetched whole)
    deltas: int = 0  # how many deltas were fetched, one after the other (node/delta.py)


class RelayServer:
    """The chunks this node holds of one version, served to other rollout nodes."""

    def __init__(
        self, server: Server, run_id: str, on_newer: Callable[[], object] | None = None
    ) -> None:
        self.server = server
        self.run_id = run_id
        # Told of each version a peer asks for that is newer than the one held: a trainer
        # has it, so this node can fetch it now rather than at its next poll.
        self.on_newer = on_newer
        self.endpoint = server.endpoint  # bound on the host peers reach (open_relay)
        self._held: tuple[WeightAssembly, bytes] | None = None  # assembly, ticket
        self.served = 0  # chunks sent
        self.absent = 0  # requests for chunks not held (yet)
        self.refused = 0  # requests with a wrong ticket, or no request of this endpoint
        self._replying: set[asyncio.Task[None]] = set()
        self._recent = RecentChunks(RELAY_RECENT_CHUNKS)  # by (assembly, index)
        self._waiting = 0  # requests waiting for their chunk
        self._arrived = asyncio.Event()  # set (and replaced) when the held chunks change
        self._watcher: asyncio.Task[None] | None = None
        self._newest_asked = 0  # the newest version a request asked for

    def hold(self, assembly: WeightAssembly, ticket: bytes) -> None:
        """Serve `assembly`'s chunks as they arrive (and after), until `drop` or the next hold."""
        self.drop()
        self._held = (assembly, ticket)

    def drop(self) -> None:
        """Serve nothing: before the held buffer is reused or let go."""
        self._held = None
        self._recent.clear()

    @property
    def version(self) -> int | None:
        return self._held[0].version if self._held is not None else None

    async def answer(self, request: protocol.WeightChunkRequest) -> protocol.TrainerReply:
        held = self._held
        if held is None or (held[0].version, held[0].base) != (request.version, request.base):
            self.absent += 1
            # (once per version number: anyone can send a request without a ticket, and a
            # stranger's version 10**9 costs one poll, not one per request)
            if self.on_newer is not None and request.version > max(
                self.version or 0, self._newest_asked
            ):
                self._newest_asked = request.version
                self.on_newer()
            return protocol.Error(code="gone", message=f"no version {request.version} here")
        assembly, ticket = held
        if ticket and not hmac.compare_digest(request.ticket, ticket):
            self.refused += 1
            return protocol.Error(code="invalid", message="no such ticket")
        if not 0 <= request.index < assembly.num_chunks:
            self.refused += 1
            return protocol.Error(code="invalid", message=f"no chunk {request.index}")
        data = None
        if await self._until_present(assembly, request.index):
            data = await self._sealed(assembly, request.index)
        if data is None:
            self.absent += 1
            return protocol.Error(code="absent", message=f"no chunk {request.index} yet")
        self.served += 1
        return protocol.WeightChunk(
            version=request.version, index=request.index, data=memoryview(data), base=request.base
        )

    async def _sealed(self, assembly: WeightAssembly, index: int) -> bytes | None:
        """Chunk `index` as served, from the few last asked for (every other node asks for
        the same chunk at about the same time: it is sealed again once, not once each)."""
        key = (id(assembly), index)
        data = self._recent.get(key)
        if data is None:
            data = await blocking(assembly.served, index)
            if data is not None:
                self._recent.put(key, data)
        return data

    async def _until_present(self, assembly: WeightAssembly, index: int) -> bool:
        """Whether chunk `index` of the held `assembly` is here, waiting up to RELAY_HOLD_S
        for it (the asker gets it as soon as it is, and sends no request again meanwhile)."""
        if index in assembly.present:
            return True
        if self._waiting >= RELAY_MAX_WAITING:
            return False
        self._waiting += 1
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch(), name="relay-watch")
        deadline = time.monotonic() + RELAY_HOLD_S
        try:
            while index not in assembly.present:
                left = deadline - time.monotonic()
                if left <= 0 or self._held is None or self._held[0] is not assembly:
                    return False
                with contextlib.suppress(TimeoutError):
                    await wait_for(self._arrived.wait(), left)
            return True
        finally:
            self._waiting -= 1

    async def _watch(self) -> None:
        """While requests wait: wake them whenever the held chunks change."""
        seen: tuple[int, int] | None = None
        while self._waiting:
            await asyncio.sleep(RELAY_WATCH_S)
            held = self._held
            now = (id(held[0]), len(held[0].present)) if held is not None else None
            if now != seen:
                seen = now
                self._arrived.set()
                self._arrived = asyncio.Event()

    async def _reply(self, envelope: list[bytes], request: protocol.WeightChunkRequest) -> None:
        await self.server.reply(envelope, await self.answer(request))

    async def serve(self) -> None:
        """Answer until cancelled: Hello, and chunk requests, each in a task of its own (it
        may wait for its chunk); nothing else. One asker's replies can come out of the order
        of its requests: each chunk names its index."""
        try:
            while True:
                envelope, msg = await self.server.recv()
                match msg:
                    case protocol.WeightChunkRequest():
                        task = asyncio.create_task(self._reply(envelope, msg))
                        self._replying.add(task)
                        task.add_done_callback(self._replying.discard)
                        continue
                    case protocol.Hello():
                        reply = protocol.answer_hello(msg, self.run_id, self.version or 0)
                    case _:
                        self.refused += 1
                        reply = protocol.Error(code="unknown", message="a relay serves chunks only")
                await self.server.reply(envelope, reply)
        finally:
            for task in [*self._replying, *([self._watcher] if self._watcher else [])]:
                task.cancel()

    def close(self) -> None:
        self.drop()
        self.server.close()


async def fetch_relayed(
    assembly: WeightAssembly,
    info: protocol.PolicyInfo,
    trainer: Client,
    me: str,
    relays: Sequence[RelayPeer] = (),
) -> FetchStats:
    """Every chunk `assembly` misses: this node's share from the trainer, the others' from
    their owners among `relays`, and from the trainer whatever an owner did not give.
    Raises what TrainerSource.fetch raises (Superseded, PeerUnavailable, ...); a relay's
    failure only moves its chunks to the trainer."""
    stats = FetchStats()
    peers = {relay.node_id: relay for relay in relays if relay.node_id != me}
    source = TrainerSource(info, trainer, RELAY_WINDOW) if peers else TrainerSource(info, trainer)
    owner = owners(info.version, [me, *peers], assembly.num_chunks)
    owed: dict[str, list[int]] = {}
    for index in assembly.missing():
        owed.setdefault(owner[index], []).append(index)
    moved: asyncio.Queue[list[int]] = asyncio.Queue()  # chunks given up on a relay
    tasks = [
        asyncio.create_task(
            _from_relay(assembly, info, trainer, peers[node_id], indices, moved, stats),
            name=f"relay-{node_id}",
        )
        for node_id, indices in owed.items()
        if node_id != me
    ]
    try:
        await source.fetch(assembly, owed.get(me, []))
        while any(not task.done() for task in tasks) or not moved.empty():
            if moved.empty():
                waiting = asyncio.create_task(moved.get())
                done, _ = await asyncio.wait(
                    [waiting, *(t for t in tasks if not t.done())],
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if waiting not in done:
                    waiting.cancel()
                    continue
                indices = waiting.result()
            else:
                indices = moved.get_nowait()
            await source.fetch(assembly, indices)
        await source.fetch(assembly, assembly.missing())  # none, unless a task failed oddly
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        source.close()
    stats.from_trainer = source.received
    stats.nbytes = assembly.nbytes
    stats.delta_base = assembly.base
    return stats


async def _from_relay(
    assembly: WeightAssembly,
    info: protocol.PolicyInfo,
    trainer: Client,
    relay: RelayPeer,
    indices: list[int],
    moved: asyncio.Queue[list[int]],
    stats: FetchStats,
) -> None:
    """Chunks `indices` from `relay`, asked again while it says "absent"; on giving up, what
    is still missing of them goes to `moved` (for the trainer)."""
    client = plain_client(relay.endpoint, trainer)
    wanted = list(indices)
    retry = ABSENT_RETRY_S
    started = last_progress = time.monotonic()
    present = len(assembly.present)
    why = ""
    try:
        await client.handshake(SEALED_HANDSHAKE_TIMEOUT_S)
        while True:
            wanted = [i for i in wanted if i not in assembly.present]
            if not wanted:
                return
            # the next few: an owner takes its share from the trainer in order
            requests = [
                protocol.WeightChunkRequest(
                    version=info.version, index=i, ticket=info.ticket, base=assembly.base
                )
                for i in wanted[:RELAY_ROUND]
            ]
            holds_version = gave = False
            async for reply in client.pipelined(requests, RELAY_WINDOW, RELAY_REPLY_TIMEOUT_S):
                match reply:
                    case protocol.WeightChunk(version=info.version, index=index, base=base) if (
                        index in wanted and base == assembly.base
                    ):
                        holds_version = gave = True
                        if await blocking(assembly.add, index, reply.data):
                            stats.from_relays += 1
                    case protocol.Error(code="absent"):
                        holds_version = True
                    case protocol.Error(code="gone"):
                        pass
                    case _:
                        raise ProtocolError(f"answered a chunk request with {reply}"[:300])
            now = time.monotonic()
            if len(assembly.present) > present:  # chunks came, from here or elsewhere
                present, last_progress, retry = len(assembly.present), now, ABSENT_RETRY_S
            if gave:
                continue
            if not holds_version and now - started > RELAY_STALL_S:
                why = f"held no version {info.version} for {RELAY_STALL_S:.0f} s"
                return
            if now - last_progress > RELAY_STALL_S:
                why = f"gave nothing for {RELAY_STALL_S:.0f} s while nothing else came"
                return
            await asyncio.sleep(retry)
            retry = min(2 * retry, ABSENT_RETRY_MAX_S)
    except (PeerUnavailable, ProtocolError, ValueError) as e:
        why = str(e)[:200]
    except asyncio.CancelledError:
        why = "cancelled"  # the fetch ended: nothing to hand on
        raise
    finally:
        client.close()
        left = [i for i in wanted if i not in assembly.present]
        if left and why != "cancelled":
            stats.relay_failures[relay.node_id] = why
            log.info(
                "relay %s: %s; %d chunks of version %d from the trainer instead",
                relay.node_id,
                why,
                len(left),
                info.version,
            )
            moved.put_nowait(left)


def relay_peers(records: Sequence[protocol.NodeRecord], me: str) -> list[RelayPeer]:
    """The other rollout nodes that serve as relays, from the directory's records."""
    return sorted(
        RelayPeer(r.node_id, r.endpoint)
        for r in records
        if r.role == "rollout" and r.endpoint and r.node_id != me
    )


def open_relay(
    net: NetConfig,
    maddrs: Sequence[str],
    run_id: str,
    on_newer: Callable[[], object] | None = None,
) -> RelayServer | None:
    """A relay on the host of this node's first announced IPv4 address (others reach its DHT
    there), at net.relay_port; None when net.relay is off or no such address is known."""
    if not net.relay:
        return None
    for maddr in maddrs:
        parts = maddr.split("/")  # "/ip4/10.0.0.2/tcp/41000/p2p/..."
        if len(parts) > 2 and parts[1] == "ip4" and parts[2] != "0.0.0.0":
            host = parts[2]
            break
    else:
        log.warning("no IPv4 address to serve a relay on (DHT addresses: %s)", list(maddrs))
        return None
    # No CURVE: with keys it serves only sealed chunks, to holders of the version's ticket.
    server = Server(
        f"tcp://{host}:{net.relay_port or '*'}",
        protocol.trainer_request_decoder,
        net.max_message_bytes,
    )
    return RelayServer(server, run_id, on_newer)
