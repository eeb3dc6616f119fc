"""Delta versions: a policy version as the bytes that changed since the version before,
for rollout nodes behind slow links.

    trainer  version v-1 and v, cut into the same chunks ──each chunk: v-1 XOR v, zstd──▶
             a frame (none where the chunk's hash did not change) ──▶ the delta's bytes:
             a header (sizes, both checksums, each frame's length) and the frames
             ──▶ a PolicySnapshot of its own (`base` = v-1; chunked, hashed, sealed under
             v's key), served beside v (node/publisher.py)
    rollout  holds v-1 (its checksum is the delta's `base_sha256`) ──the delta's chunks,
             from the trainer or relays, each checked against the delta's manifest──▶
             `apply`: chunk i of v = chunk i of v-1 XOR frame i, written in its place and
             checked against v's own manifest (WeightAssembly.fill) ──▶ v, exactly the
             bytes a full fetch gives

Why XOR and zstd: between two steps most of the weights a sampler uses keep every bit
(SmolLM2-135M in bf16 at lr 1e-5: about 3% of the values change per step), and XOR turns
a value that did not change into zero bytes, which zstd packs into nearly nothing; a
changed value costs about its size. What a node makes is checked against the version's
own manifest (the trainer's word, over CURVE), so a wrong base, a bad frame or a hostile
relay ends in a refused version, never in wrong weights. Nothing here trusts the delta's
header: sizes, lengths and checksums are checked before a byte is written, and a frame
never decompresses past its chunk.
"""

from __future__ import annotations

import functools
import mmap
import struct

import numpy as np
import zstandard

from agentjet import protocol
from agentjet.config import NetConfig
from node.weights import Buffer, PolicySnapshot, WeightAssembly, checked_manifest, chunked

MAGIC = b"AJDELTA1"
# magic, chunk count, the version's size, the base's and the version's checksums (sha256)
HEADER = struct.Struct("<8sIQ32s32s")
FRAME_LENGTH = struct.Struct("<I")
# zstd's fastest level: a delta of SmolLM2-135M (bf16) takes ~0.4 s on one core, and
# higher levels gained under 1% of its size (bench/LOG.md).
ZSTD_LEVEL = 1
# A delta bigger than this share of its version is not served: the version whole costs
# about as much on a link, and nothing to make on a node.
MAX_DELTA_SHARE = 0.8


def delta_due(net: NetConfig, version: int, fetched_over_wire: bool) -> bool:
    """Whether a trainer serves `version` as a delta too: net.version_deltas, a node has
    fetched a version over a network (`fetched_over_wire`; nodes that map versions need no
    delta), and not a version every node fetches whole (net.version_full_every: the chain
    of deltas starts again from it)."""
    every = net.version_full_every
    return net.version_deltas and fetched_over_wire and not (every and version % every == 0)


def make_delta(base: PolicySnapshot, new: PolicySnapshot) -> bytearray | None:
    """`new` as its changes from `base` (the format above); None when they are not cut
    alike (another size, another chunk size), so no delta can say one from the other."""
    if base.nbytes != new.nbytes or base.chunk_bytes != new.chunk_bytes:
        return None
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    frames: list[bytes] = []
    with memoryview(base.stored) as old, memoryview(new.stored) as now:
        for index in range(new.num_chunks):
            if base.hashes[index] == new.hashes[index]:
                frames.append(b"")
                continue
            begin = index * new.chunk_bytes
            end = min(begin + new.chunk_bytes, new.nbytes)
            changed = np.bitwise_xor(
                np.frombuffer(old[begin:end], np.uint8), np.frombuffer(now[begin:end], np.uint8)
            )
            frames.append(compressor.compress(changed.data))
    header = HEADER.pack(
        MAGIC,
        new.num_chunks,
        new.nbytes,
        bytes.fromhex(base.sha256),
        bytes.fromhex(new.sha256),
    )
    lengths = b"".join(FRAME_LENGTH.pack(len(frame)) for frame in frames)
    return bytearray(b"".join([header, lengths, *frames]))


def delta_snapshot(base: PolicySnapshot, new: PolicySnapshot) -> PolicySnapshot | None:
    """`new`'s delta from `base` as a trainer serves it: cut into `new`'s chunk size,
    hashed, sealed under `new`'s key and ticket; None when there is none to make or it is
    not worth serving (over MAX_DELTA_SHARE of the version)."""
    blob = make_delta(base, new)
    if blob is None or len(blob) > MAX_DELTA_SHARE * new.nbytes:
        return None
    made = chunked(blob, new.version, new.chunk_bytes, seal=False)
    return PolicySnapshot(
        version=new.version,
        nbytes=made.nbytes,
        chunk_bytes=made.chunk_bytes,
        hashes=made.hashes,
        sha256=made.sha256,
        stored=blob,
        key=new.key,
        ticket=new.ticket,
        base=base.version,
        base_sha256=base.sha256,
    )


def manifest(delta: PolicySnapshot) -> protocol.DeltaManifest:
    """What a PolicyInfo says of `delta` (made by `delta_snapshot`)."""
    return protocol.DeltaManifest(
        base=delta.base,
        base_sha256=delta.base_sha256,
        nbytes=delta.nbytes,
        chunk_hashes=list(delta.hashes),
        sha256=delta.sha256,
    )


def delta_info(info: protocol.PolicyInfo) -> protocol.PolicyInfo:
    """The version `info` announces as its delta's chunks: what fetching them needs (its
    manifest, the version's key, ticket and sealed endpoint), fetched like a version's
    (node/relay.py `fetch_relayed`) into `delta_assembly(info)`."""
    delta = info.delta
    assert delta is not None
    return protocol.PolicyInfo(
        version=info.version,
        nbytes=delta.nbytes,
        sha256=delta.sha256,
        num_chunks=len(delta.chunk_hashes),
        lineage=info.lineage,
        chunk_bytes=info.chunk_bytes,
        chunk_hashes=delta.chunk_hashes,
        key=info.key,
        ticket=info.ticket,
        sealed_endpoint=info.sealed_endpoint,
    )


def delta_assembly(info: protocol.PolicyInfo) -> WeightAssembly:
    """Where the chunks of the delta `info` announces arrive; ValueError when its manifest
    does not hold together."""
    delta = info.delta
    assert delta is not None
    hashes = checked_manifest(
        f"the delta of policy version {info.version}",
        delta.chunk_hashes,
        delta.sha256,
        delta.nbytes,
        info.chunk_bytes,
        info.key,
    )
    if not 0 <= delta.base < info.version:
        raise ValueError(f"policy version {info.version}: a delta from version {delta.base}")
    return WeightAssembly(
        info.version, delta.nbytes, info.chunk_bytes, hashes, info.key, base=delta.base
    )


def apply(
    target: WeightAssembly, base: Buffer | mmap.mmap, delta: Buffer | mmap.mmap, base_sha256: str
) -> None:
    """Write the version `target` awaits from `base` (the bytes of the version whose
    checksum is `base_sha256`) and `delta` (its whole bytes), every chunk checked against
    `target`'s manifest as it is written. ValueError when the delta is not one of this
    version from this base, or a chunk comes out wrong (then `target` is not complete)."""
    frames = _frames(target, delta, base_sha256)
    if len(base) != target.nbytes:
        raise ValueError(f"a base of {len(base)} bytes for a version of {target.nbytes}")
    decompressor = zstandard.ZstdDecompressor()
    with memoryview(base) as old:
        for index, frame in enumerate(frames):
            begin = index * target.chunk_bytes
            size = min(target.chunk_bytes, target.nbytes - begin)
            before = np.frombuffer(old[begin : begin + size], np.uint8)
            changed = _decompressed(decompressor, frame, size, index) if len(frame) else None
            target.fill(index, functools.partial(_xor_into, before=before, changed=changed))


def _xor_into(place: memoryview, before: np.ndarray, changed: np.ndarray | None) -> None:
    """`place` = `before` XOR `changed` (a copy of `before` when nothing changed)."""
    out = np.frombuffer(place, np.uint8)
    if changed is None:
        out[:] = before
    else:
        np.bitwise_xor(before, changed, out=out)


def _frames(
    target: WeightAssembly, delta: Buffer | mmap.mmap, base_sha256: str
) -> list[memoryview]:
    """The delta's frames, one per chunk of `target`, once its header says it is this
    version's from the base `base_sha256` and its lengths add up; else ValueError."""
    view = memoryview(delta)
    if len(view) < HEADER.size:
        raise ValueError("a delta shorter than its header")
    # (the version's own checksum, last, is for people reading a delta: its manifest,
    # checked chunk by chunk, says more)
    magic, count, nbytes, old, _ = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise ValueError("not a delta (its magic)")
    if count != target.num_chunks or nbytes != target.nbytes:
        raise ValueError(
            f"a delta of {count} chunks, {nbytes} bytes, for a version of "
            f"{target.num_chunks} chunks, {target.nbytes} bytes"
        )
    if old.hex() != base_sha256:
        raise ValueError("a delta from another base than the version held here")
    offset = HEADER.size + count * FRAME_LENGTH.size
    if len(view) < offset:
        raise ValueError("a delta shorter than its frame lengths")
    lengths = [FRAME_LENGTH.unpack_from(view, HEADER.size + i * 4)[0] for i in range(count)]
    if offset + sum(lengths) != len(view):
        raise ValueError(f"a delta of {len(view)} bytes whose frames say otherwise")
    frames = []
    for length in lengths:
        frames.append(view[offset : offset + length])
        offset += length
    return frames


def _decompressed(
    decompressor: zstandard.ZstdDecompressor, frame: memoryview, size: int, index: int
) -> np.ndarray:
    """Frame `index` decompressed: exactly `size` bytes, else ValueError (never more)."""
    try:
        data = decompressor.decompress(frame, max_output_size=size)
    except zstandard.ZstdError as e:
        raise ValueError(f"delta frame {index} does not decompress: {e}") from None
    if len(data) != size:
        raise ValueError(f"delta frame {index}: {len(data)} bytes, not {size}")
    return np.frombuffer(data, np.uint8)
