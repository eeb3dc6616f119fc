"""Policy versions as bytes: serialize, chunk, hash, seal, verify, reassemble, checkpoint.

    trainer: parameters (CPU or GPU) ──to_safetensors: one host buffer──▶ chunks ──▶ blake3
             of each (the manifest; its sha256 is the version's checksum) ──▶ with keys,
             each sealed under the version's own AES-256-GCM key ──▶ PolicySnapshot ──▶ wire
    rollout: manifest (PolicyInfo, from the trainer over CURVE) ──▶ each chunk as it comes:
             WeightAssembly: unsealed into its place in one buffer, hash ok? ──▶ state_dict
             (views of that buffer) ──▶ engine

A sealed chunk can travel on a socket without CURVE (node/publisher.py): only nodes that
were given the version's key over CURVE can read it, and its hash in the manifest, not the
socket it came on, decides whether it is the trainer's. A rollout node loads a version only
when every chunk arrived and matched.
Tied parameters (SmolLM2 ties lm_head to the embeddings) travel once: we ship
`named_parameters()`, which lists a shared tensor under one name only.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import secrets
import shutil
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import blake3
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from agentjet import protocol
from agentjet.errors import ModelError
from agentjet.progress import CountingReader, ProgressReport

CHECKPOINT_META = "agentjet.json"
# A sealed chunk is its plain bytes encrypted with AES-256-GCM, this tag appended.
SEAL_TAG_BYTES = 16
SEAL_KEY_BYTES = 32
CHUNK_HASH_BYTES = 32  # blake3
TICKET_BYTES = 16

Buffer = bytes | bytearray | memoryview
# The safetensors format's names of the dtypes policy versions travel in.
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
# In the newest checkpoint only: what a trainer needs to resume (trainable parameters,
# optimizer state, version). Older checkpoints drop it: it is 3x the trainable weights.
RESUME_STATE = "trainer_state.pt"


@dataclass(frozen=True)
class PolicySnapshot:
    """One version as a trainer serves it: its chunks one after another in `stored`, each
    sealed (AES-256-GCM under the version's own `key`, tag appended) when the swarm has
    keys, else plain; and its manifest, the blake3 hash of each plain chunk."""

    version: int
    nbytes: int  # of the safetensors bytes
    chunk_bytes: int
    hashes: tuple[bytes, ...]
    sha256: str  # manifest_digest(hashes): equal weights, equal digest, whoever made them
    stored: mmap.mmap | bytearray  # never changed once made
    key: bytes = b""  # b"": the chunks are stored plain
    ticket: bytes = b""  # asked of every request for a sealed chunk on the open socket

    @property
    def num_chunks(self) -> int:
        return len(self.hashes)

    def chunk(self, index: int) -> memoryview:
        """Chunk `index` as stored (sealed or plain): a view, not a copy."""
        stride = self.chunk_bytes + (SEAL_TAG_BYTES if self.key else 0)
        return memoryview(self.stored)[index * stride : (index + 1) * stride]


def snapshot(
    model: torch.nn.Module,
    version: int,
    chunk_bytes: int,
    dtype: torch.dtype | None = None,
    seal: bool = False,
) -> PolicySnapshot:
    """The parameters that train (with LoRA: the adapters only) as one version in chunks,
    cast to `dtype` on the way (None: as they are), sealed under a fresh key if `seal`."""
    tensors = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    blob = to_safetensors(tensors, {"policy_version": str(version)}, dtype)
    return chunked(blob, version, chunk_bytes, seal)


def chunked(
    blob: mmap.mmap | bytearray, version: int, chunk_bytes: int, seal: bool
) -> PolicySnapshot:
    """`blob` cut into chunks of `chunk_bytes` (the last one shorter), hashed, and sealed
    into a buffer of their own if `seal`. Sealing consumes `blob`: a mapping's pages are
    handed back as each chunk is sealed, so a version is in memory about once, not twice."""
    view = memoryview(blob)
    pieces = [view[i : i + chunk_bytes] for i in range(0, len(blob), chunk_bytes)] or [view]
    hashes = tuple(chunk_hash(piece) for piece in pieces)
    if not seal:
        return PolicySnapshot(
            version, len(blob), chunk_bytes, hashes, manifest_digest(hashes), blob
        )
    key = AESGCM.generate_key(bit_length=256)
    aead = AESGCM(key)
    stored = anonymous(len(blob) + SEAL_TAG_BYTES * len(pieces))
    out = memoryview(stored)
    offset = 0
    for index, piece in enumerate(pieces):
        end = offset + len(piece) + SEAL_TAG_BYTES
        aead.encrypt_into(seal_nonce(version, index), piece, None, out[offset:end])
        offset = end
        if isinstance(blob, mmap.mmap):
            release_pages(blob, index * chunk_bytes, index * chunk_bytes + len(piece))
    out.release()
    return PolicySnapshot(
        version,
        len(blob),
        chunk_bytes,
        hashes,
        manifest_digest(hashes),
        stored,
        key,
        secrets.token_bytes(TICKET_BYTES),
    )


def anonymous(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping (pages exist once written; MADV_DONTNEED frees them,
    which it would not in a shared one)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def release_pages(mapping: mmap.mmap, begin: int, end: int) -> None:
    """Hand the whole pages of mapping[begin:end] back to the system (they read as zeros)."""
    page = mmap.PAGESIZE
    low, high = -(-begin // page) * page, end // page * page
    if high > low:
        mapping.madvise(mmap.MADV_DONTNEED, low, high - low)


def chunk_hash(data: Buffer) -> bytes:
    return blake3.blake3(data).digest()


def manifest_digest(hashes: Sequence[bytes]) -> str:
    """A version's checksum: sha256 of its chunks' hashes in order."""
    return hashlib.sha256(b"".join(hashes)).hexdigest()


def seal_nonce(version: int, index: int) -> bytes:
    """Unique per chunk under a version's key (each version has a key of its own)."""
    return struct.pack(">QI", version, index)


def to_safetensors(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], dtype: torch.dtype | None = None
) -> mmap.mmap:
    """`tensors` (on any device) in the safetensors format, each copied straight into its
    place in one host buffer: the only host copy, and no whole-model copy on a GPU (a
    cast or a non-contiguous tensor makes a temporary of that one tensor). The buffer is an
    anonymous mapping: its memory goes back to the system when it is dropped."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        kind = dtype or tensor.dtype
        nbytes = tensor.numel() * kind.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[kind],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes with spaces
    blob = anonymous(8 + len(head) + offset)
    blob[:8] = struct.pack("<Q", len(head))
    blob[8 : 8 + len(head)] = head
    start = 8 + len(head)
    with torch.no_grad():
        for name, tensor in tensors.items():
            begin, end = header[name]["data_offsets"]
            if begin == end:
                continue
            place = torch.frombuffer(
                blob, dtype=dtype or tensor.dtype, count=tensor.numel(), offset=start + begin
            )
            place.copy_(tensor.reshape(-1))
    return blob


class SpareBuffer:
    """The buffer of the version a node loaded last, offered to its next fetch of the same
    size: its pages exist already (writing fresh pages was a third of a SmolLM2-135M fetch
    on a 2-core box, bench/LOG.md). Taken only once no tensor of it lives: torch holds a
    reference to a buffer while any tensor on it does, and an engine may keep the tensors
    it was given (the vLLM engine's CPU copy is them)."""

    def __init__(self) -> None:
        self._buffer: mmap.mmap | None = None

    def keep(self, buffer: mmap.mmap) -> None:
        self._buffer = buffer

    def take(self, nbytes: int) -> mmap.mmap | None:
        buffer, self._buffer = self._buffer, None
        if buffer is None or len(buffer) != nbytes:
            return None
        # `buffer` here and getrefcount's argument: any other reference is a live tensor's
        return buffer if sys.getrefcount(buffer) == 2 else None


class WeightAssembly:
    """One policy version's chunks, arriving in any order, each written in its place in one
    buffer: unsealed straight into it (with the version's key) or copied, then checked
    against its hash in the manifest; a chunk that fails is not counted (the next copy of
    it overwrites it). The buffer is an anonymous mapping: pages exist once written, so an
    announced size allocates nothing, and the whole goes back to the system when the last
    tensor of it does."""

    def __init__(
        self,
        version: int,
        nbytes: int,
        chunk_bytes: int,
        hashes: tuple[bytes, ...],
        key: bytes,
        spare: SpareBuffer | None = None,
    ) -> None:
        self.version = version
        self.nbytes = nbytes
        self.chunk_bytes = chunk_bytes
        self.hashes = hashes
        self._aead = AESGCM(key) if key else None
        self.present: set[int] = set()  # chunks written and checked
        self._claimed: set[int] = set()  # chunks being written (by a bridge thread)
        self._lock = threading.Lock()
        reused = spare.take(nbytes) if spare is not None else None
        if reused is not None:
            self.blob = reused
            return
        try:
            self.blob = anonymous(nbytes)
        except OSError as e:
            raise ValueError(
                f"policy version {version}: no room for {nbytes} bytes ({e})"
            ) from None

    @classmethod
    def of(cls, info: protocol.PolicyInfo, spare: SpareBuffer | None = None) -> WeightAssembly:
        """For the version `info` announces; ValueError when its manifest does not hold
        together (hashes, digest, sizes, key)."""
        hashes = tuple(info.chunk_hashes)
        count = len(hashes)
        if not hashes or any(len(h) != CHUNK_HASH_BYTES for h in hashes):
            raise ValueError(f"policy version {info.version}: a malformed manifest")
        if manifest_digest(hashes) != info.sha256:
            raise ValueError(f"policy version {info.version}: the manifest is not its checksum's")
        if info.chunk_bytes < 1 or not (
            (count - 1) * info.chunk_bytes < info.nbytes <= count * info.chunk_bytes
        ):
            raise ValueError(
                f"policy version {info.version}: {count} chunks cannot hold {info.nbytes} bytes"
            )
        if len(info.key) not in (0, SEAL_KEY_BYTES):
            raise ValueError(f"policy version {info.version}: a key of {len(info.key)} bytes")
        return cls(info.version, info.nbytes, info.chunk_bytes, hashes, info.key, spare)

    @property
    def num_chunks(self) -> int:
        return len(self.hashes)

    def missing(self) -> list[int]:
        return [i for i in range(self.num_chunks) if i not in self.present]

    def add(self, index: int, data: Buffer) -> bool:
        """Chunk `index` as served (sealed or plain); False, and nothing written, when it is
        here already or being added from another source (relays and the trainer may both
        send it; node/relay.py); ValueError, and it stays missing, when it is no chunk of
        this version or does not unseal or does not match its hash."""
        if not 0 <= index < self.num_chunks:
            raise ValueError(f"policy version {self.version} has no chunk {index}")
        with self._lock:
            if index in self.present or index in self._claimed:
                return False
            self._claimed.add(index)
        try:
            self._write(index, data)
        finally:
            with self._lock:
                self._claimed.discard(index)
        return True

    def _write(self, index: int, data: Buffer) -> None:
        begin = index * self.chunk_bytes
        size = min(self.chunk_bytes, self.nbytes - begin)
        sealed_size = size + (SEAL_TAG_BYTES if self._aead else 0)
        if len(data) != sealed_size:
            raise ValueError(f"chunk {index}: {len(data)} bytes, not {sealed_size}")
        with memoryview(self.blob)[begin : begin + size] as place:
            if self._aead is None:
                place[:] = data
            else:
                try:
                    self._aead.decrypt_into(seal_nonce(self.version, index), data, None, place)
                except InvalidTag:
                    raise ValueError(f"chunk {index} does not unseal with its key") from None
            if chunk_hash(place) != self.hashes[index]:
                raise ValueError(f"chunk {index} does not match its hash in the manifest")
        with self._lock:
            self.present.add(index)

    def served(self, index: int) -> bytes | None:
        """Chunk `index` as its trainer serves it, for a relay (node/relay.py): sealed again
        under the version's key (AES-GCM under one key and nonce turns equal bytes into
        equal bytes: the trainer's very chunk), or a copy of the plain one; None while this
        node does not hold it."""
        if index not in self.present:
            return None
        begin = index * self.chunk_bytes
        with memoryview(self.blob)[begin : min(begin + self.chunk_bytes, self.nbytes)] as plain:
            if self._aead is None:
                return bytes(plain)
            return self._aead.encrypt(seal_nonce(self.version, index), plain, None)

    def finish(self) -> dict[str, torch.Tensor]:
        """The state dict (tensors are views of the one buffer), or ValueError when chunks
        are missing (nothing is loaded then)."""
        if len(self.present) < self.num_chunks:
            raise ValueError(f"policy version {self.version}: {len(self.missing())} chunks missing")
        return from_safetensors(self.blob)


def from_safetensors(blob: bytearray | mmap.mmap) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors `blob` as views of it (no copy); ValueError when it is
    not one this module writes (a dtype outside SAFETENSORS_DTYPES, offsets outside it)."""
    try:
        (length,) = struct.unpack_from("<Q", blob)
        header = json.loads(bytes(blob[8 : 8 + length]))
        start = 8 + length
        if not isinstance(header, dict) or start > len(blob):
            raise ValueError("no header")
        tensors = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            kind = DTYPES_BY_NAME[entry["dtype"]]
            shape = [int(n) for n in entry["shape"]]
            if any(n < 0 for n in shape):
                raise ValueError(f"{name}: shape {shape}")
            begin, end = (int(n) for n in entry["data_offsets"])
            count = math.prod(shape)
            if not 0 <= begin <= end <= len(blob) - start or end - begin != count * kind.itemsize:
                raise ValueError(f"{name}: offsets {begin}..{end} do not fit")
            if count == 0:
                tensors[name] = torch.empty(shape, dtype=kind)
                continue
            flat = torch.frombuffer(blob, dtype=kind, count=count, offset=start + begin)
            tensors[name] = flat.view(shape)
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"not a policy version's safetensors: {e!r}") from None
    return tensors


def save_checkpoint(
    model: Any,
    tokenizer: Any,
    directory: Path,
    version: int,
    extra: dict[str, Any],
    state_dict: dict[str, torch.Tensor] | None = None,
    resume_state: dict[str, Any] | None = None,
) -> Path:
    """An HF folder (safetensors) that transformers and `agentjet eval` load; atomic rename.
    `state_dict`: the weights to save in place of the model's own (LoRA merged in).
    `resume_state`: saved beside them as RESUME_STATE (see `read_resume_state`)."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    if resume_state is not None:
        torch.save({"policy_version": version, **resume_state}, tmp / RESUME_STATE)
    (tmp / CHECKPOINT_META).write_text(json.dumps({"policy_version": version, **extra}))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest version folders under `root` (0 = keep all);
    returns what was deleted. Folders are named v000123, so name order is version order;
    a half-written `.tmp` folder is left to the next save, which replaces it."""
    if keep <= 0:
        return []
    versions = sorted(p for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit())
    doomed = versions[:-keep]
    for directory in doomed:
        shutil.rmtree(directory, ignore_errors=True)
    return doomed


def read_resume_state(checkpoints: Path) -> dict[str, Any] | None:
    """The resume state of the checkpoint `checkpoints/latest` names, or None when there is
    none; a damaged one is a ModelError naming the file (resuming elsewhere would silently
    lose the run). Bytes read go to stderr: a bar on a terminal, else a line every few seconds
    and one saying what was loaded, how much and how fast."""
    latest = checkpoints / "latest"
    if not latest.exists():
        return None
    path = checkpoints / latest.read_text().strip() / RESUME_STATE
    if not path.exists():
        return None
    try:
        size = path.stat().st_size
        with open(path, "rb") as file, ProgressReport(f"loading {path}", size, "B") as report:
            # Saved on any device, read onto the CPU (the optimizer moves state to its params).
            reader = cast(BinaryIO, CountingReader(file, report.update))
            state = torch.load(reader, weights_only=True, map_location="cpu")
        if not isinstance(state, dict) or not {"policy_version", "params", "optimizer"} <= set(
            state
        ):
            raise ValueError("missing policy_version, params or optimizer")
    except Exception as e:
        raise ModelError(
            f"cannot resume from {path}: {e}. Move that checkpoint aside to resume from an "
            "earlier one, or use a new run dir to start afresh"
        ) from None
    return state


def read_checkpoint_meta(directory: Path) -> dict[str, Any]:
    path = Path(directory) / CHECKPOINT_META
    return json.loads(path.read_text()) if path.exists() else {}
