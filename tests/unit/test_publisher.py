"""node/publisher.py: what a trainer announces of a version, and what its sealed endpoint
gives to whom."""

from __future__ import annotations

import pytest
import torch

from agentjet import protocol
from node.publisher import Publisher, announced, sealed_bind_endpoint
from node.weights import PolicySnapshot, chunked, to_safetensors

pytestmark = pytest.mark.unit


def version(number: int, seal: bool) -> PolicySnapshot:
    return chunked(to_safetensors({"w": torch.ones(3000)}, {}), number, 4096, seal)


def test_the_sealed_endpoint_binds_beside_the_trainer_and_is_announced_with_its_host():
    assert sealed_bind_endpoint("tcp://0.0.0.0:5556") == "tcp://0.0.0.0:*"
    assert sealed_bind_endpoint("tcp://0.0.0.0:5556", 7001) == "tcp://0.0.0.0:7001"
    assert sealed_bind_endpoint("ipc:///tmp/t.ipc") == "ipc:///tmp/t.ipc.sealed"
    assert announced("tcp://0.0.0.0:41234", "tcp://10.0.0.5:5556") == "tcp://10.0.0.5:41234"
    assert announced("ipc:///tmp/t.ipc.sealed", "ipc:///tmp/t.ipc") == "ipc:///tmp/t.ipc.sealed"


def test_only_a_sealed_versions_chunks_with_its_ticket_leave_by_the_sealed_endpoint():
    publisher = Publisher(version(1, seal=True), "run")
    publisher.publish(version(2, seal=True))
    publisher.publish(version(3, seal=True))  # version 1 is gone now
    info = publisher.info(protocol.Lineage())
    assert info.version == 3 and info.key and len(info.chunk_hashes) == info.num_chunks == 3
    ask = protocol.WeightChunkRequest(version=3, index=0, ticket=info.ticket)
    assert isinstance(publisher.chunk(ask, sealed=True), protocol.WeightChunk)
    previous_ticket = publisher.previous.ticket if publisher.previous else b""
    for request, code in [
        (protocol.WeightChunkRequest(version=3, index=0), "invalid"),  # no ticket
        (protocol.WeightChunkRequest(version=3, index=0, ticket=previous_ticket), "invalid"),
        (protocol.WeightChunkRequest(version=3, index=3, ticket=info.ticket), "invalid"),
        (protocol.WeightChunkRequest(version=1, index=0, ticket=info.ticket), "gone"),
    ]:
        reply = publisher.chunk(request, sealed=True)
        assert isinstance(reply, protocol.Error) and reply.code == code, request
    # over CURVE (the trainer's own socket) no ticket is asked; the version before still serves
    assert isinstance(
        publisher.chunk(protocol.WeightChunkRequest(version=2, index=1)), protocol.WeightChunk
    )


def test_the_version_before_is_let_go_before_the_next_is_made():
    now = [100.0]
    publisher = Publisher(version(1, seal=False), "run", clock=lambda: now[0])
    publisher.publish(version(2, seal=False))
    one = protocol.WeightChunkRequest(version=1, index=0)
    assert isinstance(publisher.chunk(one), protocol.WeightChunk)
    now[0] += 2.5  # (its fetch is over)
    publisher.retire()
    reply = publisher.chunk(one)
    assert isinstance(reply, protocol.Error) and reply.code == "gone"
    two = protocol.WeightChunkRequest(version=2, index=0)
    assert isinstance(publisher.chunk(two), protocol.WeightChunk)  # the newest stays
    publisher.publish(version(3, seal=False))
    assert isinstance(publisher.chunk(two), protocol.WeightChunk)  # now the one before


def test_a_plain_version_is_never_served_on_the_sealed_endpoint():
    publisher = Publisher(version(1, seal=False), "run")
    info = publisher.info(protocol.Lineage())
    assert not info.key and not info.sealed_endpoint
    reply = publisher.chunk(protocol.WeightChunkRequest(version=1, index=0), sealed=True)
    assert isinstance(reply, protocol.Error) and reply.code == "invalid"


def test_a_poll_gets_the_newest_version_without_its_manifest_key_or_ticket():
    snap = chunked(to_safetensors({"w": torch.ones(3000)}, {}), 1, 64, seal=True)
    publisher = Publisher(snap, "run")
    publisher.sealed_endpoint = "tcp://10.0.0.5:41234"
    full, poll = publisher.info(protocol.Lineage()), publisher.info(protocol.Lineage(), False)
    assert len(full.chunk_hashes) == snap.num_chunks > 100
    assert full.key and full.ticket and full.sealed_endpoint
    assert (poll.version, poll.sha256, poll.nbytes) == (full.version, full.sha256, full.nbytes)
    assert not (poll.chunk_hashes or poll.key or poll.ticket or poll.sealed_endpoint)
    assert len(protocol.encode(poll)) < 300 < 32 * snap.num_chunks < len(protocol.encode(full))


def test_the_version_before_goes_before_a_step_once_nobody_fetches_it():
    now = [100.0]
    publisher = Publisher(version(1, seal=False), "run", clock=lambda: now[0])
    assert not publisher.retire_idle(2.0)  # nothing before the first version
    publisher.publish(version(2, seal=False))
    now[0] += 1.5
    assert not publisher.retire_idle(2.0)  # a fetch of v1 may still be under way
    one = protocol.WeightChunkRequest(version=1, index=0)
    assert isinstance(publisher.chunk(one), protocol.WeightChunk)  # one is
    now[0] += 1.5
    assert not publisher.retire_idle(2.0)  # asked 1.5 s ago
    two = protocol.WeightChunkRequest(version=2, index=0)
    assert isinstance(publisher.chunk(two), protocol.WeightChunk)  # (the newest's don't count)
    now[0] += 1.0
    assert publisher.retire_idle(2.0)
    reply = publisher.chunk(one)
    assert isinstance(reply, protocol.Error) and reply.code == "gone"
    assert isinstance(publisher.chunk(two), protocol.WeightChunk)  # the newest stays
    assert not publisher.retire_idle(2.0)


def test_a_version_being_fetched_over_a_slow_link_outlives_the_steps_that_overtake_it():
    now = [100.0]
    publisher = Publisher(version(1, seal=False), "run", clock=lambda: now[0])
    publisher.publish(version(2, seal=False))
    one = protocol.WeightChunkRequest(version=1, index=0)
    two = protocol.WeightChunkRequest(version=2, index=0)
    for _ in range(3):  # a slow fetch of v1: a chunk every second
        now[0] += 1.0
        assert isinstance(publisher.chunk(one), protocol.WeightChunk)
    publisher.retire()  # before v3 is made: v1 is being fetched, it stays
    assert not publisher.retire_idle(2.0)
    publisher.publish(version(3, seal=False))  # nobody fetched v2: it goes, not v1
    assert isinstance(publisher.chunk(one), protocol.WeightChunk)
    reply = publisher.chunk(two)
    assert isinstance(reply, protocol.Error) and reply.code == "gone"
    assert publisher.previous is not None and publisher.previous.version == 1
    now[0] += 2.5  # v1's fetch ended
    publisher.retire()
    assert publisher.previous is None and publisher.published.version == 3
