"""How a rollout node reaches a trainer: its client, and a direct probe of who answers.

    rollout node ──trainer_client──▶ Client(endpoint, hello, keys, timeout)   (its usual socket)
                 ──probe──▶ fresh socket ──GroupStatusQuery([])──▶ GroupStatus | None

A probe is how a rollout node tells a live trainer from a record that outlives its trainer
(swarm.record_ttl_s): only what answers now, with the lineage it answers with, counts, and
only as the trainer whose node id answers (a trainer restarted on the same endpoint is a
new node: the one the record named is gone).
"""

from __future__ import annotations

from agentjet import protocol
from agentjet.config import Config
from agentjet.errors import ProtocolError
from agentjet.identity import NodeKeys
from agentjet.transport import Client, PeerUnavailable


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
