"""A peer without the swarm's keys is refused by a real trainer, a real coordinator and
the swarm's DHT.

Strangers (no keys at all, or a keypair of their own) send real requests (submit a group,
ask for the policy and its weight chunks, report, ask for work and status) straight at the
sockets: none is answered, none has any effect, and each server counts the refused
handshakes. The same requests from a peer with the swarm's keys are answered. A stranger
cannot join the swarm's DHT either, so it cannot read the directory of nodes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from agentjet import protocol
from agentjet.config import SwarmConfig
from agentjet.errors import AgentjetError
from agentjet.keys import SwarmKeys, new_keys, read_keys
from node.swarm import Directory, read_directory, start_dht, visible_maddrs
from tests.factories import make_group
from tests.integration.test_coordinator import (  # noqa: F401
    Coordinators,
    coordinators,
    wait_until_serving,
)
from tests.integration.test_trainer_node import Launched, connect, trainer  # noqa: F401

pytestmark = pytest.mark.integration

# Loopback answers in milliseconds once connected; a stranger waits this long for nothing.
STRANGER_WAIT_S = 1.0
STRANGERS = {"no keys": None, "another keypair": new_keys()}


def ask(endpoint: str, keys: SwarmKeys | None, message: msgspec.Struct) -> bytes | None:
    """Send one request on a fresh socket; the reply, or None if none came in time."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            keys.secure_client(sock)
        sock.connect(endpoint)
        sock.send(protocol.encode(message))
        if not sock.poll(int(STRANGER_WAIT_S * 1000)):
            return None
        return sock.recv()


def test_a_trainer_serves_only_peers_with_the_swarm_keys(trainer: Launched) -> None:  # noqa: F811
    requests = [
        protocol.SubmitGroup(group=make_group("stranger")),
        protocol.PolicyQuery(),
        protocol.WeightChunkRequest(version=0, index=0),
        protocol.GroupStatusQuery(group_ids=["stranger"]),
    ]

    async def scenario() -> None:
        member = await connect(trainer)  # also waits until the trainer serves
        for name, keys in STRANGERS.items():
            for request in requests:
                reply = await asyncio.to_thread(ask, trainer.endpoint, keys, request)
                assert reply is None, (name, request)
        # nothing a stranger sent arrived: the group was never queued
        status = await member.request(protocol.GroupStatusQuery(group_ids=["stranger"]))
        assert isinstance(status, protocol.GroupStatus)
        assert status.statuses == {"stranger": "unknown"}
        info = await member.request(protocol.PolicyQuery())
        assert isinstance(info, protocol.PolicyInfo) and info.version == 0
        member.close()

    asyncio.run(scenario())
    stopped = trainer.stop()
    assert stopped["counts/denied_handshakes"] >= len(STRANGERS) * len(requests)
    assert stopped["counts/rejected_messages"] == 0


def test_a_coordinator_serves_only_peers_with_the_swarm_keys(coordinators: Coordinators) -> None:  # noqa: F811
    proc = coordinators.start(coordinators.config())
    requests = [
        protocol.StatusRequest(),
        protocol.WorkRequest(node_id="stranger", max_groups=2, policy_version=0),
        protocol.GroupReport(node_id="stranger", grant_id="g", rewards=[1.0, 0.0]),
        protocol.Heartbeat(node_id="stranger", role="rollout"),
    ]

    async def scenario() -> protocol.CoordinatorStatus:
        member = coordinators.client("member")
        await wait_until_serving(member, proc)
        for name, keys in STRANGERS.items():
            for request in requests:
                reply = await asyncio.to_thread(ask, coordinators.endpoint, keys, request)
                assert reply is None, (name, request)
        status = await member.request(protocol.StatusRequest())
        member.close()
        assert isinstance(status, protocol.CoordinatorStatus)
        return status

    status = asyncio.run(scenario())
    assert status.grants_issued == 0 and "stranger" not in status.nodes
    assert status.denied_handshakes >= len(STRANGERS) * len(requests)
    assert status.rejected_messages == 0
    assert proc.poll() is None


def test_the_swarm_dht_admits_only_peers_with_the_keys(keys_file: Path) -> None:
    keys = read_keys(keys_file)
    config = SwarmConfig(run_id="keys-test", startup_attempts=1, startup_timeout_s=30)
    first = start_dht(config, keys)
    try:
        record = protocol.NodeRecord(node_id="trainer-x", role="trainer", time=time.time())
        assert Directory(first, config).publish(record)
        joining = msgspec.structs.replace(config, initial_peers=visible_maddrs(first))
        for stranger in STRANGERS.values():
            with pytest.raises(AgentjetError, match="could not start the swarm's DHT"):
                start_dht(joining, stranger).shutdown()  # shut down only if it wrongly joined
        assert [r.node_id for r in read_directory(joining, keys)] == ["trainer-x"]
    finally:
        first.shutdown()
