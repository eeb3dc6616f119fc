"""node/relay.py: rollout nodes pass a version's chunks on to each other; every chunk is
checked against the trainer's manifest, so a bad or dead relay costs a fetch from the
trainer, never a wrong weight. Real ZeroMQ sockets on loopback, in one process."""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter

import pytest
import torch

from agentjet import protocol
from agentjet.transport import Server
from node import relay as relay_module
from node.relay import FetchStats, RelayPeer, RelayServer, fetch_relayed, owners, relay_peers
from node.weights import WeightAssembly
from tests.hostile_relay import CorruptingRelay
from tests.version_server import VersionServer

pytestmark = pytest.mark.unit

TENSORS = {"w": torch.arange(40_000, dtype=torch.float32), "b": torch.ones(77)}
CHUNK_BYTES = 8192
MAX_MESSAGE_BYTES = 1 << 20
HOST = "tcp://127.0.0.1:*"


def test_owners_share_the_chunks_round_robin_whatever_order_the_members_come_in():
    members = ["c", "a", "b"]
    share = owners(7, members, 10)
    assert share == owners(7, list(reversed(members)), 10)
    assert sorted(Counter(share).values()) == [3, 3, 4]
    assert owners(8, members, 10) != share  # the offset moves with the version
    assert owners(1, ["a"], 4) == ["a"] * 4


def test_relays_are_the_other_rollout_nodes_records_that_name_an_endpoint():
    records = [
        protocol.NodeRecord(node_id="t", role="trainer", endpoint="tcp://h:1"),
        protocol.NodeRecord(node_id="r1", role="rollout", endpoint="tcp://h:2"),
        protocol.NodeRecord(node_id="r2", role="rollout"),  # serves none
        protocol.NodeRecord(node_id="me", role="rollout", endpoint="tcp://h:3"),
    ]
    assert relay_peers(records, "me") == [RelayPeer("r1", "tcp://h:2")]


def a_trainer(seal: bool) -> VersionServer:
    """A trainer serving TENSORS as version 3 (sealed with `seal`)."""
    return VersionServer(TENSORS, 3, CHUNK_BYTES, MAX_MESSAGE_BYTES, seal)


class Node:
    """A rollout node's part in a fetch: its relay, its assembly, its trainer client."""

    def __init__(self, name: str, trainer: VersionServer, relay: type[RelayServer] = RelayServer):
        self.name = name
        self.trainer = trainer
        server = Server(HOST, protocol.trainer_request_decoder, MAX_MESSAGE_BYTES)
        self.relay = relay(server, "run")
        self.serving = asyncio.create_task(self.relay.serve())
        self.client = trainer.client(name)
        self.assembly: WeightAssembly | None = None

    @property
    def peer(self) -> RelayPeer:
        return RelayPeer(self.name, self.relay.endpoint)

    async def fetch(self, relays: list[RelayPeer]) -> FetchStats:
        info = await self.client.request(protocol.PolicyQuery())
        assert isinstance(info, protocol.PolicyInfo)
        self.assembly = WeightAssembly.of(info)
        self.relay.hold(self.assembly, info.ticket)
        return await fetch_relayed(self.assembly, info, self.client, self.name, relays)

    def weights(self) -> dict[str, torch.Tensor]:
        assert self.assembly is not None
        return self.assembly.finish()

    async def close(self) -> None:
        self.serving.cancel()
        await asyncio.gather(self.serving, return_exceptions=True)
        self.relay.close()
        self.client.close()


def same(weights: dict[str, torch.Tensor]) -> bool:
    return weights.keys() == TENSORS.keys() and all(
        torch.equal(weights[name], TENSORS[name]) for name in TENSORS
    )


@pytest.mark.parametrize("seal", [True, False], ids=["sealed", "plain"])
def test_three_nodes_end_with_the_trainers_bytes_and_the_trainer_sends_each_chunk_once(seal):
    async def scenario() -> tuple[list[FetchStats], int, int, list[Node]]:
        trainer = a_trainer(seal)
        nodes = [Node(name, trainer) for name in ("n1", "n2", "n3")]
        peers = [node.peer for node in nodes]
        try:
            stats = await asyncio.gather(*(node.fetch(peers) for node in nodes))
            return stats, trainer.chunks_sent, trainer.publisher.published.num_chunks, nodes
        finally:
            await asyncio.gather(*(node.close() for node in nodes))
            await trainer.close()

    stats, sent, num_chunks, nodes = asyncio.run(scenario())
    assert all(same(node.weights()) for node in nodes)
    assert sent == num_chunks == sum(s.from_trainer for s in stats)
    assert sum(s.from_relays for s in stats) == 2 * num_chunks
    assert not any(s.relay_failures for s in stats)
    # each node passed on about a third of the version: its share, to the two others
    served = [node.relay.served for node in nodes]
    assert sum(served) == 2 * num_chunks and min(served) >= statistics.mean(served) - 2


def test_a_relay_serving_bad_chunks_costs_a_fetch_from_the_trainer_never_a_wrong_weight():
    async def scenario() -> tuple[FetchStats, Node, int]:
        trainer = a_trainer(seal=True)
        good, bad = Node("good", trainer), Node("bad", trainer, relay=CorruptingRelay)
        me = Node("me", trainer)
        try:
            await asyncio.gather(good.fetch([]), bad.fetch([]))  # both hold the whole version
            before = trainer.chunks_sent
            stats = await me.fetch([good.peer, bad.peer])
            return stats, me, trainer.chunks_sent - before
        finally:
            await asyncio.gather(good.close(), bad.close(), me.close())
            await trainer.close()

    stats, me, sent = asyncio.run(scenario())
    assert same(me.weights())
    assert set(stats.relay_failures) == {"bad"}
    assert "does not unseal" in stats.relay_failures["bad"]
    assert stats.from_relays > 0 and sent == stats.from_trainer > 0
    assert me.assembly is not None
    assert stats.from_relays + stats.from_trainer == me.assembly.num_chunks


def test_a_dead_or_silent_relay_costs_a_fetch_from_the_trainer(monkeypatch):
    monkeypatch.setattr(relay_module, "SEALED_HANDSHAKE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(relay_module, "RELAY_STALL_S", 0.3)

    async def scenario() -> tuple[FetchStats, Node]:
        trainer = a_trainer(seal=True)
        silent = Node("silent", trainer)  # answers, but never holds the version
        gone = Server(HOST, protocol.trainer_request_decoder, MAX_MESSAGE_BYTES)
        dead = RelayPeer("dead", gone.endpoint)
        gone.close()  # nothing listens there now
        me = Node("me", trainer)
        try:
            return await me.fetch([silent.peer, dead]), me
        finally:
            await asyncio.gather(silent.close(), me.close())
            await trainer.close()

    stats, me = asyncio.run(scenario())
    assert same(me.weights())
    assert set(stats.relay_failures) == {"silent", "dead"}
    assert "held no version" in stats.relay_failures["silent"]
    assert me.assembly is not None
    assert stats.from_relays == 0 and stats.from_trainer == me.assembly.num_chunks


def test_a_relay_serves_only_what_it_holds_and_only_for_the_versions_ticket(monkeypatch):
    monkeypatch.setattr(relay_module, "RELAY_HOLD_S", 0.1)  # "not here yet" after waiting

    async def scenario() -> tuple[bytes, list[protocol.TrainerReply]]:
        trainer = a_trainer(seal=True)
        snap = trainer.publisher.published
        info = trainer.publisher.info(protocol.Lineage())
        node = Node("n", trainer)
        assembly = WeightAssembly.of(info)
        node.relay.hold(assembly, info.ticket)
        assembly.add(1, snap.chunk(1))

        def ask(index: int, ticket: bytes = info.ticket, version: int = 3):
            return node.relay.answer(
                protocol.WeightChunkRequest(version=version, index=index, ticket=ticket)
            )

        try:
            return bytes(snap.chunk(1)), [
                await ask(1),  # the trainer's very bytes
                await ask(0),  # not here yet
                await ask(1, ticket=b"x" * 16),
                await ask(1, version=4),
                await ask(snap.num_chunks),
            ]
        finally:
            await node.close()
            await trainer.close()

    trainers_chunk, (served, *refused) = asyncio.run(scenario())
    assert isinstance(served, protocol.WeightChunk) and served.index == 1
    assert bytes(served.data) == trainers_chunk  # sealed again: the trainer's very bytes
    codes = [reply.code for reply in refused if isinstance(reply, protocol.Error)]
    assert codes == ["absent", "invalid", "gone", "invalid"]


def test_a_request_for_a_newer_version_tells_the_node_once_per_version():
    async def scenario() -> int:
        told: list[int] = []
        server = Server(HOST, protocol.trainer_request_decoder, MAX_MESSAGE_BYTES)
        relay = RelayServer(server, "run", on_newer=lambda: told.append(1))
        try:
            for version in (5, 5, 5, 10**9, 6, 10**9):
                reply = await relay.answer(protocol.WeightChunkRequest(version=version, index=0))
                assert isinstance(reply, protocol.Error) and reply.code == "gone"
            return len(told)
        finally:
            relay.close()

    assert asyncio.run(scenario()) == 2  # 5, then the stranger's 10**9 once
