"""Delta versions: a policy version as the bytes that changed since the version before,
for rollout nodes behind slow links.

    trainer  version v-1 and v, cut into the same chunks ──each chunk: v-1 XOR v, zstd──▶
             a frame (none where the chunk's hash did not change) ──▶ the delta's bytes:
             a header (sizes, both checksums, each frame's length) and the frames
             ──▶ a PolicySnapshot of its own (`base` = v-1; chunked, hashed, sealed under
             v's key), served beside v (node/publisher.py)
    rollout  holds v-1 (its checksum is the delta's `base_sha256`) ──the delta's chunks,
             from the trainer or relays, each checked against the delta's manifest──▶
             `Rebuild`, while they arrive: chunk i of v = chunk i of v-1 XOR frame i,
             written in its place and checked against v's own manifest
             (WeightAssembly.fill) ──▶ v, exactly the bytes a full fetch gives
    chain    the trainer keeps the deltas of its last versions (node/publisher.py); a node
             holding v-3 fetches v-2's, v-1's and v's deltas in a row (`chain_from`;
             node/policy_sync.py `fetch_chain`), each written over the last, the last
             checked against v's manifest

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

import asyncio
import contextlib
import functools
import mmap
import struct
from collections.abc import Awaitable
from typing import TypeVar

import numpy as np
import zstandard

from agentjet import protocol
from agentjet.bridge import blocking
from agentjet.config import NetConfig
from node.weights import Buffer, PolicySnapshot, WeightAssembly, checked_manifest, chunked

T = TypeVar("T")

MAGIC = b"AJDELTA1"
# magic, chunk count, the version's size, the base's and the version's checksums (sha256)
HEADER = struct.Struct("<8sIQ32s32s")
FRAME_LENGTH = struct.Struct("<I")
# zstd's fastest level: a delta of SmolLM2-135M (bf16) takes ~0.4 s on one core, and
# higher levels gained under 1% of its size (bench/LOG.md).
ZSTD_LEVEL = 1
# A delta's chunks: smaller than a version's, so that relays pass the first ones on while
# the trainer sends the rest (a delta is a few chunks of a version's size).
DELTA_CHUNK_BYTES = 256 << 10
# While a delta arrives, what has arrived is written this often.
REBUILD_POLL_S = 0.02
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
    alike (another size, another chunk size), so no delta can say one from the other, or
    `new` is no later version (a trainer that took an older one from its peers)."""
    if base.nbytes != new.nbytes or base.chunk_bytes != new.chunk_bytes:
        return None
    if new.version <= base.version:
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
    made = chunked(blob, new.version, min(DELTA_CHUNK_BYTES, new.chunk_bytes), seal=False)
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
    """What a PolicyInfo says of `delta` (made by `delta_snapshot`), its version's key and
    ticket included (a PolicyInfo with a manifest travels over CURVE only)."""
    return protocol.DeltaManifest(
        version=delta.version,
        base=delta.base,
        base_sha256=delta.base_sha256,
        nbytes=delta.nbytes,
        chunk_bytes=delta.chunk_bytes,
        chunk_hashes=list(delta.hashes),
        sha256=delta.sha256,
        key=delta.key,
        ticket=delta.ticket,
    )


def chain_from(info: protocol.PolicyInfo, base_sha256: str) -> list[protocol.DeltaManifest]:
    """The deltas `info` announces that make its version from the version whose checksum
    is `base_sha256`, oldest first ([]: none starts there); ValueError when they are no
    chain (one not from the version the one before makes, or not ending at `info`'s)."""
    starts = [i for i, d in enumerate(info.deltas) if d.base_sha256 == base_sha256]
    if not starts:
        return []
    chain = info.deltas[starts[-1] :]
    for before, after in zip(chain, chain[1:], strict=False):
        if after.base != before.version:
            raise ValueError(f"a delta to version {before.version}, then one from {after.base}")
    if chain[-1].version != info.version:
        raise ValueError(f"deltas to version {chain[-1].version}, announced as {info.version}")
    return chain


def delta_info(info: protocol.PolicyInfo, delta: protocol.DeltaManifest) -> protocol.PolicyInfo:
    """`delta`'s chunks as a version's: what fetching them needs (its manifest, its
    version's key and ticket, the sealed endpoint of `info`'s trainer), fetched like a
    version's (node/relay.py `fetch_relayed`) into `delta_assembly(delta)`."""
    return protocol.PolicyInfo(
        version=delta.version,
        nbytes=delta.nbytes,
        sha256=delta.sha256,
        num_chunks=len(delta.chunk_hashes),
        lineage=info.lineage,
        chunk_bytes=delta.chunk_bytes,
        chunk_hashes=delta.chunk_hashes,
        key=delta.key,
        ticket=delta.ticket,
        sealed_endpoint=info.sealed_endpoint,
    )


def delta_assembly(delta: protocol.DeltaManifest) -> WeightAssembly:
    """Where `delta`'s chunks arrive; ValueError when its manifest does not hold together."""
    hashes = checked_manifest(
        f"the delta of policy version {delta.version}",
        delta.chunk_hashes,
        delta.sha256,
        delta.nbytes,
        delta.chunk_bytes,
        delta.key,
    )
    if not 0 <= delta.base < delta.version:
        raise ValueError(f"policy version {delta.version}: a delta from version {delta.base}")
    return WeightAssembly(
        delta.version, delta.nbytes, delta.chunk_bytes, hashes, delta.key, base=delta.base
    )


class Rebuild:
    """The version `target` awaits, written from `base` (the bytes of the version whose
    checksum is `base_sha256`; `target.blob` itself: in place) and the delta arriving in
    `changes`, chunk by chunk as the delta's chunks holding its frame arrive (`step`),
    each checked against `target`'s manifest as it is written: the rebuild runs while the
    delta is fetched, so little is left once the last chunk is in. Without `check`, for a
    delta to a version before `target`'s in a chain, nothing is checked and nothing marked
    present (the last delta's rebuild checks what the chain made). ValueError when the
    delta is not one of this version from this base, or a chunk comes out wrong (then
    `target` is not complete)."""

    def __init__(
        self,
        target: WeightAssembly,
        base: Buffer | mmap.mmap,
        changes: WeightAssembly,
        base_sha256: str,
        check: bool = True,
    ) -> None:
        if len(base) != target.nbytes:
            raise ValueError(f"a base of {len(base)} bytes for a version of {target.nbytes}")
        self.target = target
        self.base = base
        self.changes = changes
        self.base_sha256 = base_sha256
        self.check = check
        self.frames: list[tuple[int, int]] | None = None  # (offset, length) in the delta
        self.left: list[int] = []  # chunks of `target` not written yet, in order
        self._decompressor = zstandard.ZstdDecompressor()

    def step(self) -> bool:
        """Write every chunk whose frame has arrived whole; True once all are written."""
        if self.frames is None:
            if self.changes.nbytes < HEADER.size:
                raise ValueError("a delta shorter than its header")
            if not self._holds(0, HEADER.size) or not self._holds(0, self._table_end()):
                return False
            self.frames = _frames(self.target, self.changes.blob, self.base_sha256)
            self.left = list(range(len(self.frames)))
        waiting = []
        for index in self.left:
            offset, length = self.frames[index]
            if self._holds(offset, offset + length):
                self._write(index, offset, length)
            else:
                waiting.append(index)
        self.left = waiting
        return not waiting

    def finish(self) -> None:
        """Write what is left: every chunk of the delta must be here."""
        if not self.step():
            raise ValueError(f"the delta of policy version {self.target.version} is incomplete")

    def _table_end(self) -> int:
        (count,) = struct.unpack_from("<I", self.changes.blob, 8)
        return HEADER.size + min(count, self.target.num_chunks + 1) * FRAME_LENGTH.size

    def _holds(self, begin: int, end: int) -> bool:
        """Whether the delta's bytes begin..end have arrived (every chunk over them)."""
        size = self.changes.chunk_bytes
        last = min(max(end - 1, begin) // size, self.changes.num_chunks - 1)
        return all(i in self.changes.present for i in range(begin // size, last + 1))

    def _write(self, index: int, offset: int, length: int) -> None:
        target = self.target
        begin = index * target.chunk_bytes
        size = min(target.chunk_bytes, target.nbytes - begin)
        with memoryview(self.base) as old:
            before = np.frombuffer(old[begin : begin + size], np.uint8)
            changed = None
            if length:
                with memoryview(self.changes.blob) as blob:
                    frame = blob[offset : offset + length]
                    changed = _decompressed(self._decompressor, frame, size, index)
            write = functools.partial(_xor_into, before=before, changed=changed)
            if self.check:
                target.fill(index, write)
                return
            with memoryview(target.blob)[begin : begin + size] as place:
                write(place)


async def rebuilt_while_fetched(rebuild: Rebuild, fetch: Awaitable[T]) -> T:
    """`fetch` (of the delta's chunks into `rebuild.changes`) awaited while what has
    arrived is written, every REBUILD_POLL_S; then the rest. Its result, once the version
    is whole; ValueError (the fetch given up) when the delta does not make it."""
    task = asyncio.ensure_future(fetch)
    try:
        seen = 0
        while not task.done():
            await asyncio.wait([task], timeout=REBUILD_POLL_S)
            if len(rebuild.changes.present) != seen:
                seen = len(rebuild.changes.present)
                await blocking(rebuild.step)
        result = task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    await blocking(rebuild.finish)
    return result


def _xor_into(place: memoryview, before: np.ndarray, changed: np.ndarray | None) -> None:
    """`place` = `before` XOR `changed` (a copy of `before` when nothing changed)."""
    out = np.frombuffer(place, np.uint8)
    if changed is None:
        out[:] = before
    else:
        np.bitwise_xor(before, changed, out=out)


def _frames(
    target: WeightAssembly, delta: Buffer | mmap.mmap, base_sha256: str
) -> list[tuple[int, int]]:
    """Where each frame lies in the delta (offset, length), one per chunk of `target`,
    once its header says it is this version's from the base `base_sha256` and its
    lengths add up; else ValueError."""
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
        frames.append((offset, length))
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
