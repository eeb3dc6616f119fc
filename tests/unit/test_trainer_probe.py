"""A rollout node asks a trainer directly before it calls it gone (`answers`, used by
node/rollout_peers.py).

A directory read can miss a live trainer's record; re-sending that trainer's groups would
train them twice. Real ZMQ sockets on loopback.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from agentjet import protocol
from agentjet.config import Config, SwarmConfig
from agentjet.transport import Server
from node.trainer_link import answers, probe

pytestmark = pytest.mark.unit

HELLO = protocol.Hello(node_id="rollout-test", role="rollout")
LINEAGE = protocol.Lineage(id="3a3d9c4b1325", ancestors={"": 146})
TRAINER = "trainer-box-4242-1a2b3c"
CONFIG = msgspec.structs.replace(Config(), swarm=SwarmConfig(record_ttl_s=0.5))


def test_a_trainer_that_answers_is_not_gone_and_a_silent_one_is() -> None:
    async def scenario() -> None:
        server = Server("tcp://127.0.0.1:0", protocol.trainer_request_decoder, 1 << 20)

        async def serve(replying: bool) -> None:
            while True:
                envelope, msg = await server.recv()
                if isinstance(msg, protocol.Hello):
                    await server.reply(envelope, protocol.answer_hello(msg, "test"))
                elif replying:
                    await server.reply(
                        envelope,
                        protocol.GroupStatus(
                            statuses={}, policy_version=3, lineage=LINEAGE, node_id=TRAINER
                        ),
                    )

        task = asyncio.create_task(serve(replying=True))
        try:
            assert await answers(server.endpoint, TRAINER, HELLO, CONFIG, None)
            # What the process at the endpoint holds now, not what its record said: the
            # marks of gone trainers are read against it.
            status = await probe(server.endpoint, HELLO, CONFIG, None)
            assert status is not None
            assert (status.lineage, status.policy_version) == (LINEAGE, 3)
            # Another trainer at that endpoint (the one the record named restarted there):
            # the one the record named is gone.
            assert not await answers(
                server.endpoint, "trainer-box-4242-0f0f0f", HELLO, CONFIG, None
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # Its process alive but its trainer loop stuck: the handshake passes, the query
        # goes unanswered, and a record's lifetime later it counts as gone.
        task = asyncio.create_task(serve(replying=False))
        try:
            start = time.monotonic()
            assert not await answers(server.endpoint, TRAINER, HELLO, CONFIG, None)
            assert time.monotonic() - start < 5 * CONFIG.swarm.record_ttl_s
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            server.close()

    asyncio.run(scenario())
