"""A peer without the swarm's keys is refused by a real trainer, a real coordinator and
the swarm's DHT.

Strangers (no keys at all, or another swarm's) send real requests (submit a group, ask for
the policy and its weight chunks, report, ask for work and status) straight at the
sockets: none is answered, none has any effect, and each server counts the refused
handshakes. The same requests from a member are answered. A stranger cannot join the
swarm's DHT either, so it cannot read the directory of nodes. A member of the swarm that
claims another node's id is refused, and counted as such.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hivemind.utils.timed_storage import get_dht_time

from agentjet import protocol
from agentjet.config import SwarmConfig
from agentjet.errors import AgentjetError
from agentjet.identity import NodeKeys, RootKey, read_node_keys
from agentjet.keys import new_keys
from agentjet.protocol import Lineage
from agentjet.transport import Client, NotAMember, PeerUnavailable
from agentjet_app.cli_status import format_status
from node.dht import start_dht, visible_maddrs
from node.directory import Directory, Mark, read_directory
from tests import procs
from tests.factories import make_group
from tests.integration.test_coordinator import (  # noqa: F401
    MAX_MESSAGE_BYTES,
    Coordinators,
    coordinators,
    wait_until_serving,
)
from tests.integration.test_trainer_node import (  # noqa: F401
    Launched,
    connect,
    launched_trainer,
    trainer,
)

pytestmark = pytest.mark.integration

# Loopback answers in milliseconds once connected; a stranger waits this long for nothing.
STRANGER_WAIT_S = 1.0
# `agentjet keys revoke` joins the DHT, stores, leaves; a trainer reads it within a heartbeat.
REVOKE_TIMEOUT_S = 60.0
POLL_S = 0.1  # between asks while waiting for the trainer to read the revocation
STRANGERS = {"no keys": None, "another swarm's keys": NodeKeys.from_root(new_keys(), "stranger")}


def ask(endpoint: str, keys: NodeKeys | None, message: msgspec.Struct) -> bytes | None:
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
    keys = read_node_keys(keys_file, "trainer-x")
    config = SwarmConfig(run_id="keys-test", startup_attempts=1, startup_timeout_s=30)
    first = start_dht(config, keys)
    try:
        record = protocol.NodeRecord(node_id="trainer-x", role="trainer", time=time.time())
        assert Directory(first, config, keys).publish(record)
        # A trainer serving several policies signs each policy's record, NODE/POLICY, as
        # NODE (node/trainer_host.py).
        planner = msgspec.structs.replace(record, node_id="trainer-x/planner", policy="planner")
        assert Directory(first, config, keys).publish(planner)
        # A member may store anything (the DHT admits members), but a record is read only
        # if the node it names signed it: not one mallory signed for trainer-y or for
        # trainer-x/solver, nor one nobody signed for trainer-z.
        mallory = read_node_keys(keys_file, "mallory")
        for posed in ("trainer-y", "trainer-x/solver"):
            posing = msgspec.structs.replace(record, node_id=posed)
            assert Directory(first, config, mallory).publish(posing)
        unsigned = msgspec.structs.replace(record, node_id="trainer-z")
        assert Directory(first, config).publish(unsigned)
        joining = msgspec.structs.replace(config, initial_peers=visible_maddrs(first))
        for stranger in STRANGERS.values():
            with pytest.raises(AgentjetError, match="could not start the swarm's DHT"):
                start_dht(joining, stranger).shutdown()  # shut down only if it wrongly joined
        reader = read_node_keys(keys_file, "reader")
        read = sorted(r.node_id for r in read_directory(joining, reader))
        assert read == ["trainer-x", "trainer-x/planner"]
        assert reader.membership.refused == {"impersonation": 2, "forged": 1}
    finally:
        first.shutdown()


def test_trained_marks_intents_and_checkpoints_are_read_only_as_a_member_signed_them(
    keys_file: Path,
) -> None:
    """The DHT records a trainer writes besides its directory record are signed too: a
    mark, a batch's intent or a checkpoint record stored without a member's signature, or
    a signed one replayed under another key, says nothing to a reader."""
    keys = read_node_keys(keys_file, "trainer-x")
    config = SwarmConfig(run_id=f"marks-{time.monotonic_ns()}", startup_attempts=1)
    dht = start_dht(config, keys)
    try:
        writer = Directory(dht, config, keys)
        writer.mark_trained(["g1"], Mark("L1", 3), batch_ids=["x/1"])
        assert all(f.result() for f in writer.name_batch("x/1", ["g2"]))
        writer.record_checkpoint("peer-x", Mark("L1", 3))
        # what a member wrote without signing, or signed for other keys (replayed)
        unsigned = Directory(dht, config)
        unsigned.mark_trained(["g3"], Mark("L1", 3), batch_ids=["u/1"])
        assert all(f.result() for f in unsigned.name_batch("u/1", ["g4"]))
        unsigned.record_checkpoint("peer-u", Mark("L1", 3))
        signed_g1 = dht.get(writer.trained_prefix + "g1", latest=True).value
        dht.store(writer.trained_prefix + "g5", signed_g1, get_dht_time() + 60)
        signed_intent = dht.get(writer.intent_prefix + "g2", latest=True).value["x/1"].value
        dht.store(writer.intent_prefix + "g6", signed_intent, get_dht_time() + 60, subkey="x/1")
        # one signed by a node of another swarm's root
        other = Directory(dht, config, NodeKeys.from_root(new_keys(), "trainer-o"))
        other.mark_trained(["g7"], Mark("L1", 3))

        reader = Directory(dht, config, read_node_keys(keys_file, "reader"))
        live = [(Lineage(id="L1"), 3)]
        ids = [f"g{i}" for i in range(1, 8)]
        assert reader.trained(ids, live) == {"g1": None, "g2": "x/1"}
        assert reader.checkpoints() == {"peer-x": Mark("L1", 3)}
        assert reader.marked_batches(["x/1", "u/1"]) == {"x/1"}
        # without keys (net.insecure) every mark reads as before
        assert set(Directory(dht, config).trained(["g3", "g4"], live)) == {"g3", "g4"}
        refused = reader.keys.membership.refused  # type: ignore[union-attr]
        # g3, g5, g7's marks; g4, g6's intents; peer-u's checkpoint; u/1's mark
        assert refused == {"forged": 7}
    finally:
        dht.shutdown()


def test_a_member_claiming_another_nodes_id_is_refused(
    trainer: Launched,  # noqa: F811
    coordinators: Coordinators,  # noqa: F811
) -> None:
    """One identity per node: a member of the swarm may only speak as itself. Reporting or
    submitting in another node's name (say, to dodge its own quarantine or to frame
    another) is refused on both sockets, counted as impersonation, and the processes serve
    on."""
    proc = coordinators.start(coordinators.config())

    async def scenario() -> protocol.CoordinatorStatus:
        mallory = coordinators.client("mallory")
        await wait_until_serving(mallory, proc)
        with pytest.raises(NotAMember, match="not 'rollout-b'"):
            await mallory.request(protocol.Heartbeat(node_id="rollout-b", role="rollout"))
        # a Hello in another name, with mallory's own certificate
        posing = Client(
            coordinators.endpoint,
            protocol.coordinator_reply_decoder,
            protocol.Hello(node_id="rollout-b", role="rollout"),
            MAX_MESSAGE_BYTES,
            STRANGER_WAIT_S * 10,
            coordinators.member("mallory"),
        )
        with pytest.raises(NotAMember):
            await posing.request(protocol.StatusRequest())
        posing.close()
        assert isinstance(
            await mallory.request(protocol.Heartbeat(node_id="mallory", role="rollout")),
            protocol.Ok,
        )
        status = await mallory.request(protocol.StatusRequest())
        mallory.close()
        # the trainer: a group in another node's name
        member = await connect(trainer, name="mallory")
        framed = msgspec.structs.replace(make_group("framed"), node_id="rollout-b")
        with pytest.raises(NotAMember):
            await member.request(protocol.SubmitGroup(group=framed))
        own = msgspec.structs.replace(make_group("own"), node_id="mallory")
        ack = await member.request(protocol.SubmitGroup(group=own))
        assert isinstance(ack, protocol.GroupAck) and ack.status == "accepted"
        member.close()
        assert isinstance(status, protocol.CoordinatorStatus)
        return status

    status = asyncio.run(scenario())
    assert status.refused == {"impersonation": 2} and "rollout-b" not in status.nodes
    assert "requests refused as no member's: impersonation 2" in format_status(status)
    assert proc.poll() is None
    stopped = trainer.stop()
    assert stopped["counts/refused_impersonation"] == 1


def test_a_revoked_node_is_shut_out_of_a_live_swarm_and_nobody_else_is(
    tiny_model_dir: Path,
    tmp_path: Path,
    keys_file: Path,
    coordinators: Coordinators,  # noqa: F811
) -> None:
    """`agentjet keys revoke NAME` against a live swarm: its trainer, its coordinator and
    the swarm's DHT refuse that node from their next directory read on, serve every other
    node as before, and re-admit the name only under a certificate issued after the
    revocation. A revocation a member forged (not signed by the root) changes nothing and
    is counted."""
    run_id = "revoke-test"
    overrides = [f'swarm.run_id="{run_id}"']
    with launched_trainer(tiny_model_dir, tmp_path, keys_file, overrides) as live:

        async def scenario() -> protocol.CoordinatorStatus:
            alice_keys = live.member("alice")
            alice = await connect(live, keys=alice_keys)
            bob = await connect(live, name="bob")
            join = re.findall(r"--join (\S+)", live.log_path.read_text())[0]
            swarm = SwarmConfig(run_id=run_id, initial_peers=[join], startup_attempts=1)
            config = coordinators.config()
            published = msgspec.structs.replace(config.coordinator, publish=True)
            proc = coordinators.start(
                msgspec.structs.replace(config, coordinator=published, swarm=swarm)
            )
            at_coordinator = coordinators.client("alice")
            beat = protocol.Heartbeat(node_id="alice", role="rollout")
            await until(lambda: served_by(at_coordinator, beat, proc), "the coordinator serves")
            # a member that does not hold the root forges a revocation of bob
            forged = RootKey.from_swarm_keys(new_keys()).revoke("bob")
            dht = start_dht(swarm, live.member("mallory"), client_mode=True)
            try:
                assert Directory(dht, swarm).revoke(forged)
            finally:
                dht.shutdown()
            revoke = [sys.executable, "-m", "agentjet_app.cli", "keys", "revoke", "alice"]
            done = procs.run(
                [*revoke, "--keys", str(keys_file), "--join", join, "--run-id", run_id],
                capture_output=True,
                text=True,
                timeout=REVOKE_TIMEOUT_S,
            )
            assert done.returncode == 0 and "revoked alice" in done.stdout, done.stderr
            query = protocol.PolicyQuery()
            await until(lambda: refused_as_revoked(alice, query), "the trainer refuses alice")
            await until(lambda: refused_as_revoked(at_coordinator, beat), "so does the coordinator")
            assert isinstance(await bob.request(query), protocol.PolicyInfo)
            # nor does the swarm's DHT take alice's requests any more
            with pytest.raises(AgentjetError, match="could not start the swarm's DHT"):
                start_dht(swarm, alice_keys, client_mode=True).shutdown()
            again = await connect(live, name="alice")  # a certificate issued after it
            assert isinstance(await again.request(query), protocol.PolicyInfo)
            # `agentjet status --join` shows what the trainer refused (its directory record)
            status_cmd = [sys.executable, "-m", "agentjet_app.cli", "status", "--join", join]
            status_cmd += ["--run-id", run_id, "--keys", str(keys_file)]
            await until(lambda: status_lists_refusals(status_cmd), "status shows the refusals")
            status = await coordinators.client("bob").request(protocol.StatusRequest())
            for client in (alice, bob, again, at_coordinator):
                client.close()
            assert proc.poll() is None
            return status

        status = asyncio.run(scenario())
        stopped = live.stop()
    assert stopped["counts/refused_revoked"] >= 1
    assert stopped["counts/refused_forged"] >= 1  # the forged revocation, read at each heartbeat
    # (the coordinator's DHT peer, its beacon, reads and refuses forged revocations itself)
    assert status.refused.get("revoked", 0) >= 1


async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """Ask `condition` every POLL_S until it holds; fail after REVOKE_TIMEOUT_S."""
    deadline = time.monotonic() + REVOKE_TIMEOUT_S
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(POLL_S)


async def served_by(client: Client, request: msgspec.Struct, proc: Any) -> bool:
    assert proc.poll() is None, "the coordinator died"
    try:
        return isinstance(await client.request(request, timeout_s=1.0), protocol.Ok)
    except PeerUnavailable:
        return False


async def status_lists_refusals(command: list[str]) -> bool:
    """Whether `agentjet status --join` lists a trainer's refusals of a revoked node."""
    done = await asyncio.to_thread(
        procs.run, command, capture_output=True, text=True, timeout=REVOKE_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    return any(
        line.startswith("refused by ") and "revoked" in line for line in done.stdout.splitlines()
    )


async def refused_as_revoked(client: Client, request: msgspec.Struct) -> bool:
    """Whether `client`'s request is refused because its node is revoked (served: False)."""
    try:
        await client.request(request)
    except NotAMember as e:
        assert "revoked" in str(e)
        return True
    return False
