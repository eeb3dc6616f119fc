"""A hostile rollout node's relay, for the unit tests and bench/relay.py --faults."""

from __future__ import annotations

from agentjet import protocol
from node.relay import RelayServer


class CorruptingRelay(RelayServer):
    """Serves every chunk with one bit flipped."""

    async def answer(self, request: protocol.WeightChunkRequest) -> protocol.TrainerReply:
        reply = await super().answer(request)
        if isinstance(reply, protocol.WeightChunk):
            data = bytearray(reply.data)
            data[len(data) // 2] ^= 1
            reply = protocol.WeightChunk(
                version=reply.version, index=reply.index, data=memoryview(data), base=reply.base
            )
        return reply
