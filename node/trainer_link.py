"""How a rollout node reaches a trainer: its client, a direct probe of who answers, and
the fetch of a policy version's chunks.

    rollout node ──trainer_client──▶ Client(endpoint, hello, keys, timeout)   (its usual socket)
                 ──probe──▶ fresh socket ──GroupStatusQuery([])──▶ GroupStatus | None
                 ──fetch_chunks(PolicyInfo)──▶ CHUNK_WINDOW WeightChunkRequests in flight,
                   on the sealed endpoint when the version is sealed (node/publisher.py),
                   else, or for what that endpoint did not give, on the usual socket
                   ──▶ WeightAssembly.add (unseal, check the hash) off the event loop

A probe is how a rollout node tells a live trainer from a record that outlives its trainer
(swarm.record_ttl_s): only what answers now, with the lineage it answers with, counts, and
only as the trainer whose node id answers (a trainer restarted on the same endpoint is a
new node: the one the record named is gone).
"""

from __future__ import annotations

import logging

from agentjet import protocol
from agentjet.bridge import blocking
from agentjet.config import Config
from agentjet.errors import ProtocolError
from agentjet.identity import NodeKeys
from agentjet.transport import Client, PeerUnavailable
from node.weights import WeightAssembly

log = logging.getLogger(__name__)

# Chunk requests in flight: the trainer sends the next chunks while this node checks one.
CHUNK_WINDOW = 4
# A sealed endpoint that does not answer this soon (a firewall that lets only the trainer's
# own port through) is given up for this fetch: the chunks come over the usual socket.
SEALED_HANDSHAKE_TIMEOUT_S = 5.0


class Superseded(Exception):
    """The version being fetched is gone from its trainer: two steps overtook the fetch."""


def trainer_client(
    endpoint: str, hello: protocol.Hello, config: Config, keys: NodeKeys | None, timeout_s: float
) -> Client:
    """A client of the trainer at `endpoint`, giving up on a reply after `timeout_s`."""
    return Client(
        endpoint,
        protocol.trainer_reply_decoder,
        hello,
        config.net.max_message_bytes,
        timeout_s,
        keys,
    )


async def answers(
    endpoint: str, node_id: str, hello: protocol.Hello, config: Config, keys: NodeKeys | None
) -> bool:
    """Whether the trainer `node_id` answers at `endpoint` within a record's lifetime."""
    status = await probe(endpoint, hello, config, keys)
    return status is not None and status.node_id == node_id


async def probe(
    endpoint: str, hello: protocol.Hello, config: Config, keys: NodeKeys | None
) -> protocol.GroupStatus | None:
    """What the trainer that answers at `endpoint` within a record's lifetime says of itself
    (node id, lineage, version), or None, asked on a socket of its own (the rollout node's
    usual client may be waiting on a request in flight)."""
    client = trainer_client(endpoint, hello, config, keys, config.swarm.record_ttl_s)
    try:
        reply = await client.request(protocol.GroupStatusQuery(group_ids=[]))
    except (PeerUnavailable, ProtocolError):
        return None
    finally:
        client.close()
    return reply if isinstance(reply, protocol.GroupStatus) else None


def plain_client(endpoint: str, like: Client) -> Client:
    """A client of `endpoint` without CURVE, saying the same Hello as `like` (a trainer's
    sealed endpoint, a relay: they serve sealed chunks, or plain ones without keys)."""
    return Client(
        endpoint,
        protocol.trainer_reply_decoder,
        like.hello,
        like.max_message_bytes,
        like.timeout_s,
        context=like.context,
    )


async def fetch_chunks(assembly: WeightAssembly, info: protocol.PolicyInfo, client: Client) -> None:
    """Every chunk `assembly` misses, from the trainer `client` talks to. Raises Superseded,
    PeerUnavailable, ProtocolError, or ValueError for a chunk the trainer's own socket gave
    that does not check (nothing of it is kept)."""
    source = TrainerSource(info, client)
    try:
        await source.fetch(assembly, assembly.missing())
    finally:
        source.close()


class TrainerSource:
    """The chunks of one version from its trainer, for one fetch: on the sealed endpoint
    while it serves, else, and for what it did not give, on the trainer's own socket. Asked
    once or several times (node/relay.py asks for what relays did not give)."""

    def __init__(
        self, info: protocol.PolicyInfo, client: Client, window: int = CHUNK_WINDOW
    ) -> None:
        self.info = info
        self.client = client
        self.window = window
        self.sealed = plain_client(info.sealed_endpoint, client) if info.sealed_endpoint else None
        self.received = 0  # chunks this trainer gave

    async def fetch(self, assembly: WeightAssembly, indices: list[int]) -> None:
        """Chunks `indices` of those `assembly` still misses."""
        if self.sealed is not None:
            try:
                await self.sealed.handshake(SEALED_HANDSHAKE_TIMEOUT_S)
                await self._stream(assembly, indices, self.sealed)
            except (PeerUnavailable, ProtocolError, ValueError) as e:
                log.info(
                    "sealed endpoint %s: %s; the rest of version %d over the trainer's socket",
                    self.info.sealed_endpoint,
                    e,
                    self.info.version,
                )
                self.sealed.close()
                self.sealed = None
        await self._stream(assembly, indices, self.client)

    async def _stream(self, assembly: WeightAssembly, indices: list[int], client: Client) -> None:
        info = self.info
        missing = set(assembly.missing())
        requests = [
            protocol.WeightChunkRequest(
                version=info.version, index=i, ticket=info.ticket, base=assembly.base
            )
            for i in indices
            if i in missing
        ]
        if not requests:
            return
        async for chunk in client.pipelined(requests, self.window):
            match chunk:
                case protocol.Error(code="gone"):
                    raise Superseded(f"policy version {info.version} is gone")
                case protocol.WeightChunk(version=version, index=index, base=base) if (
                    version == info.version and index in missing and base == assembly.base
                ):
                    self.received += await blocking(assembly.add, index, chunk.data)
                case _:
                    raise ValueError(
                        f"asked for a chunk of version {info.version}, got {chunk}"[:300]
                    )

    def close(self) -> None:
        if self.sealed is not None:
            self.sealed.close()
