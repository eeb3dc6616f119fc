"""How a rollout node reaches a trainer: its client, and a direct probe of who answers.

    rollout node ──trainer_client──▶ Client(endpoint, hello, keys, timeout)   (its usual socket)
                 ──probe──▶ fresh socket ──GroupStatusQuery([])──▶ (lineage, version) | None

A probe is how a rollout node tells a live trainer from a record that outlives its trainer
(swarm.record_ttl_s): only what answers now, with the lineage it answers with, counts.
"""

from __future__ import annotations

from agentjet import protocol
from agentjet.config import Config
from agentjet.errors import ProtocolError
from agentjet.keys import SwarmKeys
from agentjet.transport import Client, PeerUnavailable


def trainer_client(
    endpoint: str, hello: protocol.Hello, config: Config, keys: SwarmKeys | None, timeout_s: float
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
    endpoint: str, hello: protocol.Hello, config: Config, keys: SwarmKeys | None
) -> bool:
    """Whether the trainer at `endpoint` answers within a record's lifetime."""
    return await probe(endpoint, hello, config, keys) is not None


async def probe(
    endpoint: str, hello: protocol.Hello, config: Config, keys: SwarmKeys | None
) -> tuple[protocol.Lineage, int] | None:
    """The lineage and version of the trainer that answers at `endpoint` within a record's
    lifetime, or None, asked on a socket of its own (the rollout node's usual client may be
    waiting on a request in flight)."""
    client = trainer_client(endpoint, hello, config, keys, config.swarm.record_ttl_s)
    try:
        reply = await client.request(protocol.GroupStatusQuery(group_ids=[]))
    except (PeerUnavailable, ProtocolError):
        return None
    finally:
        client.close()
    if not isinstance(reply, protocol.GroupStatus):
        return None
    return reply.lineage, reply.policy_version
