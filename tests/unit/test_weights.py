"""node/weights.py: a version's chunks assemble into one buffer, read back without copies."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from safetensors.torch import load as load_safetensors

from node.weights import WeightAssembly, from_safetensors, to_safetensors

pytestmark = pytest.mark.unit

TENSORS = {
    "embed": torch.randn(50, 8),
    "half": torch.randn(3, 5).to(torch.bfloat16),
    "empty": torch.zeros(0, 4),
    "ids": torch.arange(7),
}


def assembly_of(blob: bytearray, chunk: int) -> tuple[WeightAssembly, list[bytes]]:
    chunks = [bytes(blob[i : i + chunk]) for i in range(0, len(blob), chunk)]
    digest = hashlib.sha256(blob).hexdigest()
    return WeightAssembly(4, len(blob), digest, len(chunks)), chunks


def test_chunks_in_any_order_give_what_safetensors_reads_as_views_of_one_buffer() -> None:
    blob = to_safetensors(TENSORS, {"policy_version": "4"})
    assembly, chunks = assembly_of(blob, 100)
    for index in reversed(range(len(chunks))):
        assembly.add(index, chunks[index])
    state = assembly.finish()
    reference = load_safetensors(bytes(blob))
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    # No copies: every non-empty tensor lies in one buffer of the version's size.
    pointers = sorted(t.data_ptr() for t in state.values() if t.numel())
    assert pointers[-1] - pointers[0] < len(blob)
    assert not assembly.chunks  # each chunk was let go once copied


def test_a_corrupt_short_long_or_missing_chunk_is_refused() -> None:
    blob = to_safetensors(TENSORS, {})
    for damage in ("flip", "short", "long", "missing"):
        assembly, chunks = assembly_of(blob, 100)
        if damage == "flip":
            chunks[2] = bytes([chunks[2][0] ^ 1]) + chunks[2][1:]
        elif damage == "short":
            chunks[2] = chunks[2][:-1]
        elif damage == "long":
            chunks[-1] = chunks[-1] + b"x" * 200
        for index, data in enumerate(chunks):
            if not (damage == "missing" and index == 1):
                assembly.add(index, data)
        with pytest.raises(ValueError, match="missing|checksum|add up"):
            assembly.finish()
    with pytest.raises(ValueError, match="outside"):
        assembly_of(blob, 100)[0].add(10_000, b"")


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
