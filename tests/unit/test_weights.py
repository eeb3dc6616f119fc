"""node/weights.py: a version's chunks, plain or sealed, each checked against the manifest
as it arrives, assemble into one buffer and read back without copies."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct

import msgspec
import pytest
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from safetensors.torch import load as load_safetensors

from agentjet import protocol
from node.publisher import Publisher
from node.weights import (
    SEALED_KEPT,
    PolicySnapshot,
    SpareBuffer,
    WeightAssembly,
    chunked,
    from_safetensors,
    seal_nonce,
    snapshot,
    this_host,
    to_safetensors,
)

pytestmark = pytest.mark.unit

TENSORS = {
    "embed": torch.randn(50, 8),
    "half": torch.randn(3, 5).to(torch.bfloat16),
    "empty": torch.zeros(0, 4),
    "ids": torch.arange(7),
}


def version(blob: bytearray, chunk: int, seal: bool) -> tuple[protocol.PolicyInfo, list[bytes]]:
    """What a trainer announces and serves for `blob` (node/publisher.py)."""
    snap = chunked(bytearray(blob), 4, chunk, seal)
    info = Publisher(snap, "run").info(protocol.Lineage())
    return info, [bytes(snap.chunk(i)) for i in range(snap.num_chunks)]


@pytest.mark.parametrize("seal", [False, True])
def test_chunks_in_any_order_give_what_safetensors_reads_as_views_of_one_buffer(seal: bool) -> None:
    blob = to_safetensors(TENSORS, {"policy_version": "4"})
    info, chunks = version(blob, 100, seal)
    assert bool(info.key) == seal and (chunks[0] != blob[:100]) == seal
    assembly = WeightAssembly.of(info)
    for index in [*range(1, len(chunks)), 0]:  # all but the first wait for it
        assembly.add(index, chunks[index])
    state = assembly.finish()
    reference = load_safetensors(bytes(blob))
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    # No copies: every non-empty tensor lies in one buffer of the version's size.
    pointers = sorted(t.data_ptr() for t in state.values() if t.numel())
    assert pointers[-1] - pointers[0] < len(blob)


def test_equal_weights_have_equal_checksums_sealed_or_not_and_others_differ() -> None:
    blob = to_safetensors(TENSORS, {})
    plain, sealed, again = (
        version(blob, 100, False),
        version(blob, 100, True),
        version(blob, 100, True),
    )
    assert plain[0].sha256 == sealed[0].sha256 == again[0].sha256
    assert sealed[0].key != again[0].key and sealed[1] != again[1]  # a key per version made
    other = bytearray(blob)
    other[-1] ^= 1
    assert version(other, 100, False)[0].sha256 != plain[0].sha256
    assert plain[0].sha256 == hashlib.sha256(b"".join(plain[0].chunk_hashes)).hexdigest()


@pytest.mark.parametrize("seal", [False, True])
def test_a_bad_chunk_is_refused_alone_and_the_good_one_is_taken_after_it(seal: bool) -> None:
    blob = to_safetensors(TENSORS, {})
    info, chunks = version(blob, 100, seal)
    forged = bytearray(blob[100:200])
    forged[0] ^= 1
    bad = {
        "flipped": bytes([chunks[1][0] ^ 1]) + chunks[1][1:],
        "short": chunks[1][:-1],
        "long": chunks[1] + b"x",
        "another chunk": chunks[2],
        "another version's key": version(blob, 100, True)[1][1],
        # a member holds the key: what it seals still has to match the manifest's hash
        "sealed by a member": (
            AESGCM(info.key).encrypt(seal_nonce(4, 1), bytes(forged), None)
            if seal
            else bytes(forged)
        ),
    }
    assembly = WeightAssembly.of(info)
    assembly.add(0, chunks[0])
    for what, data in bad.items():
        with pytest.raises(ValueError, match="hash|unseal|bytes"):
            assembly.add(1, data)
        assert assembly.missing() == list(range(1, len(chunks))), what
    with pytest.raises(ValueError, match="missing"):
        assembly.finish()
    for index in range(1, len(chunks)):
        assembly.add(index, chunks[index])
    assert torch.equal(assembly.finish()["embed"], TENSORS["embed"])
    assert assembly.add(0, bytes(len(chunks[0]))) is False  # here already: not written
    assert torch.equal(assembly.finish()["embed"], TENSORS["embed"])
    for index in (len(chunks), -1):  # no such chunk
        with pytest.raises(ValueError, match="no chunk"):
            assembly.add(index, chunks[0])


def test_a_manifest_that_does_not_hold_together_is_refused_before_anything_is_fetched() -> None:
    info, _ = version(to_safetensors(TENSORS, {}), 100, True)
    hashes = info.chunk_hashes
    for broken in (
        msgspec.structs.replace(info, chunk_hashes=[]),
        msgspec.structs.replace(info, chunk_hashes=[h[:16] for h in hashes]),
        msgspec.structs.replace(info, chunk_hashes=hashes[:-1]),  # not its checksum's
        msgspec.structs.replace(info, nbytes=info.nbytes + 100),  # more than its chunks hold
        msgspec.structs.replace(info, nbytes=1 << 40),
        msgspec.structs.replace(info, chunk_bytes=0),
        msgspec.structs.replace(info, key=b"short"),
    ):
        with pytest.raises(ValueError):
            WeightAssembly.of(broken)


def header_blob(header: object, data: bytes = b"\0" * 16) -> bytearray:
    head = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(head)) + head + data)


@pytest.mark.parametrize(
    "blob",
    [
        bytearray(b"\1\2"),  # no length
        bytearray(struct.pack("<Q", 1 << 40) + b"{}"),  # a header longer than the blob
        header_blob(["not", "a", "dict"]),
        header_blob({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}),
        header_blob({"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}),  # past end
        header_blob({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}),  # size
        header_blob({"w": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}}),
        header_blob({"w": {"dtype": "F32", "shape": [1]}}),
        header_blob({"w": "F32"}),
    ],
)
def test_a_blob_that_is_no_version_of_ours_is_one_value_error(blob: bytearray) -> None:
    with pytest.raises(ValueError):
        from_safetensors(blob)


def test_the_last_versions_buffer_is_reused_only_once_no_tensor_of_it_lives() -> None:
    blob = to_safetensors(TENSORS, {})
    info, chunks = version(blob, 100, True)
    spare = SpareBuffer()

    def fetched() -> tuple[WeightAssembly, dict[str, torch.Tensor]]:
        assembly = WeightAssembly.of(info, spare)
        for index, data in enumerate(chunks):
            assembly.add(index, data)
        return assembly, assembly.finish()

    first, state = fetched()
    spare.keep(first.blob)
    buffer = id(first.blob)  # (a name for it would be a reference that keeps it in use)
    del first
    kept = state["embed"][3]  # a tensor of it lives on (as in a vLLM engine's copy)
    del state
    second, state = fetched()
    assert id(second.blob) != buffer  # not handed out while `kept` views it
    assert torch.equal(kept, TENSORS["embed"][3])
    spare.keep(second.blob)
    buffer = id(second.blob)
    del second, state
    third, state = fetched()
    assert id(third.blob) == buffer  # nothing of it lived: its pages are used again
    assert torch.equal(state["embed"], TENSORS["embed"])
    spare.keep(third.blob)
    assert spare.take(len(third.blob) + 1) is None  # another size: a fresh buffer


def test_a_sealed_version_is_sealed_as_asked_the_same_bytes_each_time() -> None:
    blob = to_safetensors({"w": torch.randn(64, 1024)}, {})  # 256 KiB and a header
    plain = bytes(blob)
    snap = chunked(blob, 1, 64 << 10, seal=True)
    assert bytes(snap.stored) == plain  # kept plain: each chunk is sealed when asked for
    first = [bytes(snap.chunk(i)) for i in range(snap.num_chunks)]
    assert len(snap._sealed) == min(snap.num_chunks, SEALED_KEPT)
    snap._sealed.clear()
    assert [bytes(snap.chunk(i)) for i in range(snap.num_chunks)] == first
    assembly = WeightAssembly.of(Publisher(snap, "run").info(protocol.Lineage()))
    for index, data in enumerate(first):
        assembly.add(index, data)
    assert bytes(assembly.blob) == plain


def frozen_version(tensors: dict[str, torch.Tensor], seal: bool = True) -> PolicySnapshot:
    model = torch.nn.Module()
    for name, tensor in tensors.items():
        model.register_parameter(name, torch.nn.Parameter(tensor.clone()))
    return snapshot(model, 7, 4096, seal=seal)


def test_a_node_on_the_trainers_host_maps_its_version_and_checks_every_chunk() -> None:
    tensors = {"a": torch.randn(40, 100), "b": torch.randn(3, 7)}
    snap = frozen_version(tensors)
    info = Publisher(snap, "run").info(protocol.Lineage())
    assert info.local == protocol.LocalCopy(host=this_host(), pid=os.getpid(), fd=snap.fd)
    assembly = WeightAssembly.mapped(info)
    assert assembly is not None and assembly.local and not assembly.missing()
    state = assembly.finish()
    assert all(torch.equal(state[k], t) for k, t in tensors.items())
    # A relay on that node serves the trainer's very chunks (sealed again under its key).
    assert all(assembly.served(i) == bytes(snap.chunk(i)) for i in range(snap.num_chunks))
    # Frozen: nobody can write the file, or map it writable and shared.
    with pytest.raises(PermissionError):
        os.pwrite(snap.fd, b"x", 0)
    with pytest.raises(PermissionError):
        mmap.mmap(snap.fd, snap.nbytes, flags=mmap.MAP_SHARED)

    # Not mapped, so fetched: another host, no such file, a file of other bytes, no memfd.
    other = frozen_version({"a": torch.randn(40, 100), "b": torch.randn(3, 7)})
    for local in (
        protocol.LocalCopy(host="another-boot-id", pid=os.getpid(), fd=snap.fd),
        protocol.LocalCopy(host=this_host(), pid=os.getpid(), fd=1 << 20),
        protocol.LocalCopy(host=this_host(), pid=os.getpid(), fd=other.fd),  # hash fails
    ):
        assert WeightAssembly.mapped(msgspec.structs.replace(info, local=local)) is None
    unsealed = os.memfd_create("not-frozen")
    os.ftruncate(unsealed, snap.nbytes)
    try:
        local = protocol.LocalCopy(host=this_host(), pid=os.getpid(), fd=unsealed)
        assert WeightAssembly.mapped(msgspec.structs.replace(info, local=local)) is None
    finally:
        os.close(unsealed)


def test_an_engine_that_keeps_the_tensors_leaves_the_buffer_before_for_the_next_fetch() -> None:
    """The torch engine's weights become the loaded version's tensors: that buffer is in
    use, and the one loaded before it, let go by the engine, is the next fetch's."""
    info, chunks = version(to_safetensors(TENSORS, {}), 100, True)
    spare = SpareBuffer()

    def fetched() -> tuple[int, dict[str, torch.Tensor]]:
        assembly = WeightAssembly.of(info, spare)
        for index, data in enumerate(chunks):
            assembly.add(index, data)
        spare.keep(assembly.blob)  # as the rollout node does once the engine loaded it
        return id(assembly.blob), assembly.finish()

    first, engine = fetched()
    second, engine = fetched()  # the engine takes the second version, lets the first go
    assert second != first
    third, engine = fetched()
    assert third == first  # the free one, not the engine's
    assert torch.equal(engine["embed"], TENSORS["embed"])
