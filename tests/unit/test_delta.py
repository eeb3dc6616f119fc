"""node/delta.py: a policy version as its changes from the version before. The format
(round trip, tampering, a missing or wrong base, a hostile delta), the chain that starts
again from a whole version, a trainer's Publisher serving deltas, relays passing them on,
and a rollout node's PolicySync fetching versions whole, then as deltas, then whole again
when it missed one. Real ZeroMQ sockets on loopback; the torch engine on the tiny model."""

from __future__ import annotations

import asyncio
import mmap
import struct
from pathlib import Path

import pytest
import torch
import zstandard

from agentjet import protocol
from agentjet.config import LogConfig, ModelConfig, NetConfig
from agentjet.metrics import MetricsWriter, read_metrics
from agentjet.transport import Server
from node import delta
from node.policy_sync import PolicySync
from node.publisher import DELTA_CHAIN, Publisher
from node.relay import RelayPeer, RelayServer, fetch_relayed
from node.torch_engine import TorchEngine
from node.weights import PolicySnapshot, WeightAssembly, chunked, seal_nonce, to_safetensors
from tests.hostile_relay import CorruptingRelay
from tests.version_server import VersionServer

pytestmark = pytest.mark.unit

CHUNK_BYTES = 1 << 14
MAX_MESSAGE_BYTES = 1 << 22
HOST = "tcp://127.0.0.1:*"


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(60_000, generator=gen).bfloat16(),
        "b": torch.randn(300, generator=gen).bfloat16(),
    }


def stepped(tensors: dict[str, torch.Tensor], every: int = 40) -> dict[str, torch.Tensor]:
    """`tensors` as one step changes them: a few values in each (1 in `every`)."""
    out = {name: t.clone() for name, t in tensors.items()}
    for t in out.values():
        t[::every] += 0.25
    return out


def version(tensors: dict[str, torch.Tensor], number: int, seal: bool = True) -> PolicySnapshot:
    return chunked(to_safetensors(tensors, {}), number, CHUNK_BYTES, seal)


def announced(snap: PolicySnapshot, changes: PolicySnapshot | None) -> protocol.PolicyInfo:
    """What a trainer serving `snap` (and its delta `changes`) tells a node over CURVE."""
    publisher = Publisher(snap, "run")
    info = publisher.info(protocol.Lineage())
    info.deltas = [delta.manifest(changes)] if changes is not None else []
    return info


def fetched_delta(info: protocol.PolicyInfo, changes: PolicySnapshot) -> WeightAssembly:
    """The delta's chunks as a node receives them (sealed as served), each checked."""
    assembly = delta.delta_assembly(info.deltas[0])
    for index in range(changes.num_chunks):
        assert assembly.add(index, changes.chunk(index))
    return assembly


def test_a_delta_rebuilds_the_version_bit_for_bit_from_its_base_and_is_small() -> None:
    old, new = version(weights(), 1), version(stepped(weights()), 2)
    changes = delta.delta_snapshot(old, new)
    assert changes is not None and (changes.base, changes.base_sha256) == (1, old.sha256)
    assert changes.nbytes < 0.1 * new.nbytes  # 1 value in 40 changed
    info = announced(new, changes)
    target = WeightAssembly.of(info)
    delta.Rebuild(target, old.stored, fetched_delta(info, changes), old.sha256).finish()
    assert bytes(target.blob) == bytes(new.stored)
    rebuilt = target.finish()
    assert all(torch.equal(rebuilt[n], t) for n, t in stepped(weights()).items())


def test_a_chunk_of_a_delta_that_was_tampered_with_is_refused_and_taken_again() -> None:
    old, new = version(weights(), 1), version(stepped(weights()), 2)
    changes = delta.delta_snapshot(old, new)
    assert changes is not None
    assembly = delta.delta_assembly(announced(new, changes).deltas[0])
    bad = bytearray(changes.chunk(0))
    bad[7] ^= 1
    with pytest.raises(ValueError, match="does not unseal"):
        assembly.add(0, bad)
    assert 0 in assembly.missing()
    # a delta's chunk is sealed apart from the version's own chunk of that index
    assert seal_nonce(2, 0, delta=True) != seal_nonce(2, 0)
    assert assembly.add(0, changes.chunk(0)) and 0 not in assembly.missing()


def test_a_delta_from_another_base_is_refused_before_a_byte_is_written() -> None:
    old, new = version(weights(), 1), version(stepped(weights()), 2)
    changes = delta.delta_snapshot(old, new)
    assert changes is not None
    info = announced(new, changes)
    blob = fetched_delta(info, changes)
    target = WeightAssembly.of(info)
    other = version(weights(seed=1), 1)
    with pytest.raises(ValueError, match="another base"):
        delta.Rebuild(target, other.stored, blob, other.sha256).finish()
    assert target.present == set()
    # The base's checksum, but other bytes (a node's copy gone bad): its chunks come out
    # wrong, and each is refused against the version's own manifest.
    with pytest.raises(ValueError, match="does not match its hash"):
        delta.Rebuild(target, other.stored, blob, old.sha256).finish()
    assert len(target.present) < target.num_chunks


def as_fetched(blob: bytes) -> WeightAssembly:
    """`blob` (a delta, or what passes for one) as a node holds it once every chunk came."""
    snap = chunked(bytearray(blob), 2, delta.DELTA_CHUNK_BYTES, seal=False)
    assembly = WeightAssembly(2, snap.nbytes, snap.chunk_bytes, snap.hashes, b"", base=1)
    for index in range(snap.num_chunks):
        assembly.add(index, snap.chunk(index))
    return assembly


def hostile(blob: bytes, lengths: list[int] | None = None, magic: bytes = delta.MAGIC) -> bytes:
    """`blob` (a delta) with its magic or its frame lengths replaced."""
    head = bytearray(blob[: delta.HEADER.size])
    head[:8] = magic
    _, count, *_ = delta.HEADER.unpack_from(blob)
    table = blob[delta.HEADER.size : delta.HEADER.size + 4 * count]
    if lengths is not None:
        table = b"".join(struct.pack("<I", n) for n in lengths)
    return bytes(head) + table + blob[delta.HEADER.size + 4 * count :]


def test_a_hostile_delta_is_one_clear_error_and_never_writes_past_a_chunk() -> None:
    old, new = version(weights(), 1, seal=False), version(stepped(weights()), 2, seal=False)
    info = announced(new, None)
    blob = delta.make_delta(old, new)
    assert blob is not None
    _, count, *_ = delta.HEADER.unpack_from(blob)
    lengths = [struct.unpack_from("<I", blob, delta.HEADER.size + 4 * i)[0] for i in range(count)]
    too_big = zstandard.ZstdCompressor().compress(bytes(2 * CHUNK_BYTES))
    frames_start = delta.HEADER.size + 4 * count
    bomb = bytearray(hostile(bytes(blob), [len(too_big)] + [0] * (count - 1)))
    bomb[frames_start:] = too_big
    cases = {
        "not a delta": hostile(bytes(blob), magic=b"NOTDELTA"),
        "whose frames say otherwise": hostile(bytes(blob), [n + 1 for n in lengths]),
        "shorter than its header": bytes(blob[:10]),
        "does not decompress|bytes, not": bytes(bomb),
    }
    for message, bad in cases.items():
        target = WeightAssembly.of(info)
        with pytest.raises(ValueError, match=message):
            delta.Rebuild(target, old.stored, as_fetched(bad), old.sha256).finish()
        assert target.present == set(), message


def test_a_version_is_rebuilt_chunk_by_chunk_as_its_deltas_chunks_arrive() -> None:
    big = {"w": torch.randn(300_000, generator=torch.Generator().manual_seed(2)).bfloat16()}
    old, new = version(big, 1), version(stepped(big, 4), 2)
    changes = delta.delta_snapshot(old, new)
    assert changes is not None and changes.num_chunks >= 4
    info = announced(new, changes)
    assert info.deltas[0].chunk_bytes == min(delta.DELTA_CHUNK_BYTES, CHUNK_BYTES)
    arriving = delta.delta_assembly(info.deltas[0])
    target = WeightAssembly.of(info)
    rebuild = delta.Rebuild(target, old.stored, arriving, old.sha256)
    assert not rebuild.step() and target.present == set()  # nothing has arrived
    written = []
    for index in range(changes.num_chunks):
        arriving.add(index, changes.chunk(index))
        rebuild.step()
        written.append(len(target.present))
    assert 0 < written[0] < written[-2] < target.num_chunks == written[-1]  # as they came
    assert bytes(target.blob) == bytes(new.stored)


def test_no_delta_between_versions_cut_otherwise_or_when_it_would_not_pay() -> None:
    old = version(weights(), 1)
    longer = version({**weights(), "extra": torch.ones(8, dtype=torch.bfloat16)}, 2)
    assert delta.delta_snapshot(old, longer) is None
    unrelated = version(weights(seed=5), 2)  # every value changed: about its own size
    assert delta.delta_snapshot(old, unrelated) is None
    same = delta.delta_snapshot(old, version(weights(), 2))  # nothing changed
    assert same is not None and same.nbytes < 1000
    # a trainer that took an earlier version from its peers: no delta back in time
    assert delta.delta_snapshot(version(weights(), 5), version(stepped(weights()), 4)) is None


def test_the_chain_of_deltas_starts_again_from_a_whole_version_every_k() -> None:
    net = NetConfig(version_full_every=5)
    due = [v for v in range(1, 12) if delta.delta_due(net, v, fetched_over_wire=True)]
    assert due == [1, 2, 3, 4, 6, 7, 8, 9, 11]
    assert not delta.delta_due(net, 3, fetched_over_wire=False)  # nodes map versions
    assert not delta.delta_due(NetConfig(version_deltas=False), 3, fetched_over_wire=True)
    assert delta.delta_due(NetConfig(version_full_every=0), 25, fetched_over_wire=True)


def test_a_trainer_serves_a_chain_of_deltas_to_its_newest_version() -> None:
    snaps = [version(stepped(weights(), 40 + v), v) for v in range(12)]
    publisher = Publisher(snaps[1], "run")
    for number in (2, 3, 4):
        publisher.publish(snaps[number], delta.delta_snapshot(snaps[number - 1], snaps[number]))
    info = publisher.info(protocol.Lineage())
    assert [(d.base, d.version) for d in info.deltas] == [(1, 2), (2, 3), (3, 4)]
    assert publisher.info(protocol.Lineage(), manifest=False).deltas == []  # a poll
    assert not publisher.fetched_over_wire
    # version 2 itself is gone; its delta is still served (with its own version's ticket)
    two = protocol.WeightChunkRequest(version=2, index=0, base=1)
    served = publisher.chunk(two)
    assert isinstance(served, protocol.WeightChunk) and served.base == 1
    assert info.deltas[0].ticket == snaps[2].ticket and info.deltas[0].key == snaps[2].key
    assert publisher.fetched_over_wire
    wrong_base = publisher.chunk(protocol.WeightChunkRequest(version=2, index=0, base=0))
    assert isinstance(wrong_base, protocol.Error) and wrong_base.code == "gone"
    # a node holding 2 gets the chain from 2; one holding 0 none
    assert [d.version for d in delta.chain_from(info, snaps[2].sha256)] == [3, 4]
    assert delta.chain_from(info, snaps[0].sha256) == []
    # at most DELTA_CHAIN deltas are kept
    for number in range(5, 12):
        publisher.publish(snaps[number], delta.delta_snapshot(snaps[number - 1], snaps[number]))
    assert len(publisher.info(protocol.Lineage()).deltas) == DELTA_CHAIN
    # a version without a delta breaks the chain: nothing older is kept
    publisher.publish(version(weights(), 12))
    assert publisher.info(protocol.Lineage()).deltas == [] and publisher.deltas == {}
    assert isinstance(publisher.chunk(two), protocol.Error)


def test_a_chain_of_deltas_weighs_no_more_than_its_version() -> None:
    heavy = [version(stepped(weights(), 2 + v % 2), v) for v in range(4)]  # half changes
    publisher = Publisher(heavy[0], "run")
    for number in (1, 2, 3):
        publisher.publish(heavy[number], delta.delta_snapshot(heavy[number - 1], heavy[number]))
    chain = publisher.info(protocol.Lineage()).deltas
    assert 1 <= len(chain) < 3
    assert sum(d.nbytes for d in chain) <= heavy[3].nbytes


def test_a_chain_that_does_not_hold_together_is_refused() -> None:
    snaps = [version(stepped(weights(), 40 + v), v) for v in range(4)]
    made = [
        delta.manifest(d)
        for d in (
            delta.delta_snapshot(snaps[0], snaps[1]),
            delta.delta_snapshot(snaps[2], snaps[3]),
        )
        if d
    ]
    info = announced(snaps[3], None)
    info.deltas = made  # 0 -> 1, then 2 -> 3: a gap
    with pytest.raises(ValueError, match="then one from 2"):
        delta.chain_from(info, snaps[0].sha256)
    info.deltas = made[:1]  # ends at 1, announced as 3
    with pytest.raises(ValueError, match="announced as 3"):
        delta.chain_from(info, snaps[0].sha256)


class RelayNode:
    """A rollout node's part in a delta fetch: its relay, the version it holds, its client."""

    def __init__(self, name: str, trainer: VersionServer, relay: type[RelayServer]) -> None:
        self.name = name
        self.relay = relay(Server(HOST, protocol.trainer_request_decoder, MAX_MESSAGE_BYTES), "")
        self.serving = asyncio.create_task(self.relay.serve())
        self.client = trainer.client(name)
        held = trainer.publisher.published
        self.held: tuple[str, bytes] = (held.sha256, bytes(held.stored))

    @property
    def peer(self) -> RelayPeer:
        return RelayPeer(self.name, self.relay.endpoint)

    async def fetch_delta(self, relays: list[RelayPeer]) -> tuple[bytes, int]:
        """The newest version, from its delta; its bytes and the delta chunks relays gave."""
        info = await self.client.request(protocol.PolicyQuery())
        assert isinstance(info, protocol.PolicyInfo)
        (step,) = delta.chain_from(info, self.held[0])
        changes = delta.delta_assembly(step)
        self.relay.hold(changes, info.ticket)
        fetching = delta.delta_info(info, step)
        stats = await fetch_relayed(changes, fetching, self.client, self.name, relays)
        target = WeightAssembly.of(info)
        delta.Rebuild(target, self.held[1], changes, self.held[0]).finish()
        return bytes(target.blob), stats.from_relays

    async def close(self) -> None:
        self.serving.cancel()
        await asyncio.gather(self.serving, return_exceptions=True)
        self.relay.close()
        self.client.close()


@pytest.mark.parametrize("relay", [RelayServer, CorruptingRelay], ids=["honest", "corrupting"])
def test_relays_pass_a_delta_on_and_a_bad_one_costs_a_chunk_from_the_trainer(relay) -> None:
    big = {"w": torch.randn(400_000, generator=torch.Generator().manual_seed(3)).bfloat16()}

    async def scenario() -> tuple[list[tuple[bytes, int]], bytes, int, int]:
        trainer = VersionServer(big, 1, CHUNK_BYTES, MAX_MESSAGE_BYTES, seal=True)
        nodes = [RelayNode("n1", trainer, RelayServer), RelayNode("n2", trainer, relay)]
        trainer.publish(stepped(big, 8), 2)
        changes = trainer.publisher.deltas[2]
        try:
            results = await asyncio.gather(*(n.fetch_delta([m.peer for m in nodes]) for n in nodes))
            return (
                results,
                bytes(trainer.publisher.published.stored),
                trainer.chunks_sent,
                changes.num_chunks,
            )
        finally:
            await asyncio.gather(*(node.close() for node in nodes))
            await trainer.close()

    results, expected, sent, num_chunks = asyncio.run(scenario())
    assert num_chunks > 2
    assert all(got == expected for got, _ in results)
    if relay is RelayServer:  # each delta chunk left the trainer once
        assert sent == num_chunks and sum(n for _, n in results) == num_chunks
    else:  # n2's share reached n1 refused, and came from the trainer instead
        assert sent > num_chunks and results[1][1] > 0


def full_weights(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_a_rollout_node_fetches_whole_then_as_deltas_then_whole_after_missing_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    asyncio.run(node_scenario(tiny_model_dir, tmp_path))
    rows = read_metrics(tmp_path / "metrics" / "rollout.jsonl")
    fetched = {r["policy_version"]: r for r in rows if r["event"] == "weights_fetched"}
    assert sorted(fetched) == [1, 2, 3, 6, 8]
    whole = fetched[1]["version_bytes"]
    assert fetched[1]["fetched_bytes"] == whole and "delta_from" not in fetched[1]
    assert fetched[2]["delta_from"] == 1 and fetched[2]["fetched_bytes"] < whole / 10
    # version 3's delta did not make it (the node's copy of 2 gone bad): refused, counted,
    # fetched whole
    assert "delta_from" not in fetched[3] and fetched[3]["deltas_refused"] == 1
    # the node missed 4 and 5: 6 comes as the chain of deltas 3 -> 4 -> 5 -> 6
    assert (fetched[6]["delta_from"], fetched[6]["deltas"]) == (3, 3)
    assert fetched[6]["fetched_bytes"] < whole / 3
    # 7 was served without a delta (the chain starts again from it): a node holding 6
    # has no chain to 8, and fetches it whole
    assert "delta_from" not in fetched[8] and fetched[8]["fetched_bytes"] == whole


async def node_scenario(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = TorchEngine(tiny_model_dir, dtype="float32", seed=0, device="cpu")
    base = full_weights(engine)
    steps = {v: stepped(base, 97 + v) for v in range(1, 9)}
    trainer = VersionServer(steps[1], 1, CHUNK_BYTES, MAX_MESSAGE_BYTES, seal=True)
    client = trainer.client("rollout-test")
    metrics = MetricsWriter(tmp_path, "rollout", LogConfig())
    sync = PolicySync("", engine, ModelConfig(), NetConfig(map_local=False), lambda: metrics)

    async def fetch_and_load(number: int) -> None:
        await sync.fetch("t", client, [protocol.Lineage()])
        await sync.load()
        assert sync.version == number
        loaded = engine.state_dict()
        assert all(torch.equal(loaded[n], t) for n, t in steps[number].items())

    try:
        await fetch_and_load(1)
        trainer.publish(steps[2], 2)
        await fetch_and_load(2)
        assert sync.base is not None
        spoiled = mmap.mmap(-1, len(sync.base[1]))
        spoiled[:] = sync.base[1]
        spoiled[-100:] = bytes(100)
        sync.base = (sync.base[0], spoiled)
        trainer.publish(steps[3], 3)
        await fetch_and_load(3)
        for number in (4, 5, 6):
            trainer.publish(steps[number], number)
        await fetch_and_load(6)
        trainer.publish(steps[7], 7, delta=False)
        trainer.publish(steps[8], 8)
        await fetch_and_load(8)
    finally:
        client.close()
        await trainer.close()
        metrics.close()
