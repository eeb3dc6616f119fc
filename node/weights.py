"""Policy versions as bytes: serialize, chunk, hash, seal, verify, reassemble, checkpoint.

    trainer: parameters (CPU or GPU) ──frozen_safetensors: one host buffer, a frozen
             memory file──▶ chunks ──▶ blake3 of each (the manifest; its sha256 is the
             version's checksum) ──▶ PolicySnapshot ──▶ wire: each chunk as asked, with keys
             sealed under the version's own AES-256-GCM key
    rollout: manifest (PolicyInfo, from the trainer over CURVE) ──▶ each chunk as it comes:
             WeightAssembly: unsealed into its place in one buffer, hash ok? ──▶ state_dict
             (views of that buffer) ──▶ engine
             on the trainer's host: WeightAssembly.mapped, the trainer's memory file mapped,
             every chunk's hash ok? ──▶ state_dict (views of the trainer's pages) ──▶ engine

A sealed chunk can travel on a socket without CURVE (node/publisher.py): only nodes that
were given the version's key over CURVE can read it, and its hash in the manifest, not the
socket it came on, decides whether it is the trainer's. A rollout node loads a version only
when every chunk arrived and matched. A node on the trainer's host maps the version
instead (`PolicyInfo.local`): the same check of every chunk, no bytes on a socket, and the
pages are the trainer's, so the version is in memory once for both (`agentjet local`).
The trainer freezes the file before announcing it (no writes, no size change, by anyone),
so what a node checked stays what it runs.
Tied parameters (SmolLM2 ties lm_head to the embeddings) travel once: we ship
`named_parameters()`, which lists a shared tensor under one name only.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import math
import mmap
import os
import secrets
import shutil
import stat
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
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
SEALED_KEPT = 8  # chunks a trainer keeps sealed: those relays and nodes are asking for now
FROZEN_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW

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
    """One version as a trainer serves it: its plain chunks one after another in `stored`
    (never changed once made), and its manifest, the blake3 hash of each. With the swarm's
    keys each chunk goes out sealed (AES-256-GCM under the version's own `key`, tag
    appended), sealed when asked for; the last few sealed are kept. `fd`: the frozen memory
    file `stored` maps (-1: none), which a node on this host maps instead of fetching."""

    version: int
    nbytes: int  # of the safetensors bytes
    chunk_bytes: int
    hashes: tuple[bytes, ...]
    sha256: str  # manifest_digest(hashes): equal weights, equal digest, whoever made them
    stored: mmap.mmap | bytearray
    key: bytes = b""  # b"": the chunks go out plain
    ticket: bytes = b""  # asked of every request for a sealed chunk on the open socket
    fd: int = -1
    # A delta (node/delta.py): this version's changes from version `base`, whose checksum
    # is `base_sha256` (-1: the version itself).
    base: int = -1
    base_sha256: str = ""
    _sealed: RecentChunks = field(
        default_factory=lambda: RecentChunks(SEALED_KEPT), compare=False, repr=False
    )

    @property
    def num_chunks(self) -> int:
        return len(self.hashes)

    def chunk(self, index: int) -> memoryview:
        """Chunk `index` as it is served: sealed with a key, else a view of the plain one."""
        begin = index * self.chunk_bytes
        plain = memoryview(self.stored)[begin : begin + self.chunk_bytes]
        if not self.key:
            return plain
        sealed = self._sealed.get(index)
        if sealed is None:
            sealed = seal_chunk(AESGCM(self.key), self.version, index, plain, self.base >= 0)
            self._sealed.put(index, sealed)
        return memoryview(sealed)


class RecentChunks:
    """The last few chunks as served (sealed), by key: the nodes fetching a version ask for
    the same chunk at about the same time, and it is sealed once for them, not once each."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: dict[Hashable, bytes] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, key: Hashable) -> bytes | None:
        return self._kept.get(key)

    def put(self, key: Hashable, data: bytes) -> None:
        self._kept[key] = data
        while len(self._kept) > self.size:
            del self._kept[next(iter(self._kept))]

    def clear(self) -> None:
        self._kept.clear()


def trainable_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train (with LoRA: the adapters only), by name, not copied."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def snapshot(
    model: torch.nn.Module,
    version: int,
    chunk_bytes: int,
    dtype: torch.dtype | None = None,
    seal: bool = False,
) -> PolicySnapshot:
    """The parameters that train (with LoRA: the adapters only) as one version in chunks,
    cast to `dtype` on the way (None: as they are), in a frozen memory file that nodes on
    this host can map (`frozen_safetensors`), sealed under a fresh key if `seal`."""
    tensors = trainable_params(model)
    blob, fd = frozen_safetensors(tensors, {"policy_version": str(version)}, dtype)
    try:
        made = chunked(blob, version, chunk_bytes, seal, fd)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    if fd >= 0:
        weakref.finalize(made, os.close, fd)  # the file lives on in what others mapped
    return made


def chunked(
    blob: mmap.mmap | bytearray, version: int, chunk_bytes: int, seal: bool, fd: int = -1
) -> PolicySnapshot:
    """`blob` cut into chunks of `chunk_bytes` (the last one shorter) and hashed; with
    `seal`, a fresh key and ticket for serving them sealed."""
    hashes = _hashes(blob, chunk_bytes)
    key = AESGCM.generate_key(bit_length=256) if seal else b""
    ticket = secrets.token_bytes(TICKET_BYTES) if seal else b""
    digest = manifest_digest(hashes)
    return PolicySnapshot(version, len(blob), chunk_bytes, hashes, digest, blob, key, ticket, fd)


def _hashes(blob: mmap.mmap | bytearray, chunk_bytes: int) -> tuple[bytes, ...]:
    """The blake3 hash of each chunk of `blob` (one chunk, empty, when it is empty)."""
    hashes = []
    with memoryview(blob) as view:
        for begin in range(0, max(len(blob), 1), chunk_bytes):
            with view[begin : begin + chunk_bytes] as piece:
                hashes.append(chunk_hash(piece))
    return tuple(hashes)


def anonymous(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping (pages exist once written)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


@functools.cache
def this_host() -> str:
    """This kernel's boot id: equal for processes that can share memory files ("" unknown)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def map_frozen(pid: int, fd: int, nbytes: int) -> mmap.mmap | None:
    """Process `pid`'s frozen memory file `fd` (`frozen_safetensors`) mapped copy-on-write,
    its pages shared with that process; None when it is not one of `nbytes` bytes that
    nobody can change any more (gone, another file, another process, not reachable)."""
    try:
        opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(opened)
        if not stat.S_ISREG(info.st_mode) or info.st_size != nbytes or nbytes == 0:
            return None
        if fcntl.fcntl(opened, fcntl.F_GET_SEALS) & FROZEN_SEALS != FROZEN_SEALS:
            return None
        # Private: a write (nothing here writes weights) would copy that page, not fail.
        return mmap.mmap(opened, nbytes, flags=mmap.MAP_PRIVATE)
    except OSError:  # F_GET_SEALS of a file that is no memory file
        return None
    finally:
        os.close(opened)


def chunk_hash(data: Buffer) -> bytes:
    return blake3.blake3(data).digest()


def manifest_digest(hashes: Sequence[bytes]) -> str:
    """A version's checksum: sha256 of its chunks' hashes in order."""
    return hashlib.sha256(b"".join(hashes)).hexdigest()


def seal_chunk(aead: AESGCM, version: int, index: int, plain: Buffer, delta: bool = False) -> bytes:
    """Chunk `index` of `version` (or of its `delta`) sealed: the same bytes whoever seals
    it with the key."""
    return aead.encrypt(seal_nonce(version, index, delta), plain, None)


# A delta's chunks are sealed under their version's key with this bit set in the index.
DELTA_NONCE_BIT = 1 << 31


def seal_nonce(version: int, index: int, delta: bool = False) -> bytes:
    """Unique per chunk under a version's key (each version has a key of its own), the
    chunks of the version's delta (node/delta.py) apart from its own."""
    if not 0 <= index < DELTA_NONCE_BIT:
        raise ValueError(f"no chunk {index}")
    return struct.pack(">QI", version, index | (DELTA_NONCE_BIT if delta else 0))


def _layout(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], dtype: torch.dtype | None
) -> tuple[bytes, dict[str, Any], int]:
    """The safetensors header of `tensors` (cast to `dtype`), its parsed form, and the
    whole file's size."""
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
    return head, header, 8 + len(head) + offset


def _write(
    blob: mmap.mmap,
    tensors: dict[str, torch.Tensor],
    head: bytes,
    header: dict[str, Any],
    dtype: torch.dtype | None,
) -> None:
    blob[:8] = struct.pack("<Q", len(head))
    blob[8 : 8 + len(head)] = head
    with torch.no_grad():
        for tensor, offset in _places(tensors, head, header):
            place = torch.frombuffer(
                blob, dtype=dtype or tensor.dtype, count=tensor.numel(), offset=offset
            )
            place.copy_(tensor.reshape(-1))


def _places(
    tensors: dict[str, torch.Tensor], head: bytes, header: dict[str, Any]
) -> Iterator[tuple[torch.Tensor, int]]:
    """Each tensor that has bytes, with its place in the file `_layout` laid out."""
    start = 8 + len(head)
    for name, tensor in tensors.items():
        begin, end = header[name]["data_offsets"]
        if begin != end:
            yield tensor, start + begin


def _write_file(
    fd: int,
    tensors: dict[str, torch.Tensor],
    head: bytes,
    header: dict[str, Any],
    dtype: torch.dtype | None,
) -> None:
    """`_write` through the descriptor, one tensor at a time, with no mapping of the file:
    a process forked while a writable shared mapping exists (hivemind's averagers start
    whenever a trainer joins) keeps it, and the kernel then refuses the seal for good
    (EBUSY; CI, 2026-12-06). A cast or a tensor off the CPU costs a temporary of that one
    tensor, as in `_write`."""
    _pwrite(fd, struct.pack("<Q", len(head)) + head, 0)
    with torch.no_grad():
        for tensor, offset in _places(tensors, head, header):
            flat = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous().reshape(-1)
            _pwrite(fd, flat.view(torch.uint8).numpy().data, offset)


def _pwrite(fd: int, data: Buffer, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def to_safetensors(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], dtype: torch.dtype | None = None
) -> mmap.mmap:
    """`tensors` (on any device) in the safetensors format, each copied straight into its
    place in one host buffer: the only host copy, and no whole-model copy on a GPU (a
    cast or a non-contiguous tensor makes a temporary of that one tensor). The buffer is an
    anonymous mapping: its memory goes back to the system when it is dropped."""
    head, header, nbytes = _layout(tensors, metadata, dtype)
    blob = anonymous(nbytes)
    _write(blob, tensors, head, header, dtype)
    return blob


def frozen_safetensors(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], dtype: torch.dtype | None = None
) -> tuple[mmap.mmap, int]:
    """`to_safetensors` written into a memory file (memfd) that is then frozen (sealed
    against writes and size changes) and mapped read-only: its descriptor, second, lets a
    process on this host map the same pages (`map_frozen`), and no one can change them
    after that process checked them. Not inherited by processes forked later. Without
    memory files: `to_safetensors`, descriptor -1."""
    head, header, nbytes = _layout(tensors, metadata, dtype)
    try:
        fd = os.memfd_create("agentjet-policy", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError):
        return to_safetensors(tensors, metadata, dtype), -1
    try:
        os.ftruncate(fd, nbytes)
        _write_file(fd, tensors, head, header, dtype)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, FROZEN_SEALS | fcntl.F_SEAL_SEAL)
        blob = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        blob.madvise(mmap.MADV_DONTFORK)
    except BaseException:
        os.close(fd)
        raise
    return blob, fd


class SpareBuffer:
    """The buffers of the last versions a node loaded, offered to its next fetch of the
    same size: their pages exist already (writing fresh pages was a third of a
    SmolLM2-135M fetch on a 2-core box, bench/LOG.md). One is taken only once no tensor of
    it lives: torch holds a reference to a buffer while any tensor on it does, and an
    engine may keep the tensors it was given (the torch engine's weights become them; the
    vLLM engine's CPU copy is them). Two are kept: the one loaded last is still the
    engine's, the one before is free."""

    def __init__(self) -> None:
        self._buffers: list[mmap.mmap] = []

    def keep(self, buffer: mmap.mmap) -> None:
        self._buffers = [*self._buffers[-1:], buffer]

    def take(self, nbytes: int) -> mmap.mmap | None:
        for buffer in self._buffers:
            # `buffer` here, in the list and getrefcount's argument: any other is a tensor's
            if len(buffer) == nbytes and sys.getrefcount(buffer) == 3:
                self._buffers.remove(buffer)
                return buffer
        return None


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
        blob: mmap.mmap | None = None,
        base: int = -1,
    ) -> None:
        self.version = version
        self.base = base  # a delta's base version (node/delta.py); -1: the version itself
        self.nbytes = nbytes
        self.chunk_bytes = chunk_bytes
        self.hashes = hashes
        self._aead = AESGCM(key) if key else None
        self.present: set[int] = set()  # chunks written and checked
        self._claimed: set[int] = set()  # chunks being written (by a bridge thread)
        self._lock = threading.Lock()
        self.local = blob is not None  # mapped from a trainer on this host (`mapped`)
        reused = blob if blob is not None else spare.take(nbytes) if spare is not None else None
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
        return cls(
            info.version, info.nbytes, info.chunk_bytes, cls._manifest(info), info.key, spare
        )

    @classmethod
    def mapped(cls, info: protocol.PolicyInfo) -> WeightAssembly | None:
        """The version `info` announces, whole, mapped from the memory of its trainer when
        that runs on this host (`PolicyInfo.local`): no copy, the pages shared with the
        trainer's. None when it cannot be mapped or a chunk does not match its hash in the
        manifest (then fetch it); ValueError as `of`."""
        local = info.local
        hashes = cls._manifest(info)
        if local is None or not local.host or local.host != this_host():
            return None
        blob = map_frozen(local.pid, local.fd, info.nbytes)
        if blob is None:
            return None
        if _hashes(blob, info.chunk_bytes) != hashes:
            blob.close()
            return None
        assembly = cls(info.version, info.nbytes, info.chunk_bytes, hashes, info.key, blob=blob)
        assembly.present = set(range(len(hashes)))
        return assembly

    @staticmethod
    def _manifest(info: protocol.PolicyInfo) -> tuple[bytes, ...]:
        """`info`'s chunk hashes; ValueError when its manifest does not hold together."""
        return checked_manifest(
            f"policy version {info.version}",
            info.chunk_hashes,
            info.sha256,
            info.nbytes,
            info.chunk_bytes,
            info.key,
        )

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
        size = self._size(index)
        sealed_size = size + (SEAL_TAG_BYTES if self._aead else 0)
        if len(data) != sealed_size:
            raise ValueError(f"chunk {index}: {len(data)} bytes, not {sealed_size}")

        def unseal(place: memoryview) -> None:
            if self._aead is None:
                place[:] = data
                return
            nonce = seal_nonce(self.version, index, self.base >= 0)
            try:
                self._aead.decrypt_into(nonce, data, None, place)
            except InvalidTag:
                raise ValueError(f"chunk {index} does not unseal with its key") from None

        self.fill(index, unseal)

    def _size(self, index: int) -> int:
        return min(self.chunk_bytes, self.nbytes - index * self.chunk_bytes)

    def fill(self, index: int, write: Callable[[memoryview], None]) -> None:
        """Chunk `index` written by `write` into its place in the buffer, then checked
        against its hash: present if it matches, else ValueError (it stays missing)."""
        begin = index * self.chunk_bytes
        with memoryview(self.blob)[begin : begin + self._size(index)] as place:
            write(place)
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
            return seal_chunk(self._aead, self.version, index, plain, self.base >= 0)

    def finish(self) -> dict[str, torch.Tensor]:
        """The state dict (tensors are views of the one buffer), or ValueError when chunks
        are missing (nothing is loaded then)."""
        if len(self.present) < self.num_chunks:
            raise ValueError(f"policy version {self.version}: {len(self.missing())} chunks missing")
        return from_safetensors(self.blob)


def checked_manifest(
    what: str, hashes: Sequence[bytes], sha256: str, nbytes: int, chunk_bytes: int, key: bytes
) -> tuple[bytes, ...]:
    """A manifest's chunk hashes, once they hold together: hashes of the right size, their
    digest `sha256`, as many as `nbytes` in chunks of `chunk_bytes` takes, a key of the
    right size (or none); else ValueError naming `what`."""
    hashes = tuple(hashes)
    count = len(hashes)
    if not hashes or any(len(h) != CHUNK_HASH_BYTES for h in hashes):
        raise ValueError(f"{what}: a malformed manifest")
    if manifest_digest(hashes) != sha256:
        raise ValueError(f"{what}: the manifest is not its checksum's")
    if chunk_bytes < 1 or not ((count - 1) * chunk_bytes < nbytes <= count * chunk_bytes):
        raise ValueError(f"{what}: {count} chunks cannot hold {nbytes} bytes")
    if len(key) not in (0, SEAL_KEY_BYTES):
        raise ValueError(f"{what}: a key of {len(key)} bytes")
    return hashes


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
    `resume_state`: saved beside them as RESUME_STATE (see `read_resume_state`); without a
    "params" entry, resuming reads the trainable parameters from the safetensors written here
    (a full fine-tune: its parameters are the model's weights, saved once, not twice)."""
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
    folder = checkpoints / latest.read_text().strip()
    path = folder / RESUME_STATE
    if not path.exists():
        return None
    try:
        size = path.stat().st_size
        with open(path, "rb") as file, ProgressReport(f"loading {path}", size, "B") as report:
            # Saved on any device, read onto the CPU (the optimizer moves state to its params).
            reader = cast(BinaryIO, CountingReader(file, report.update))
            state = torch.load(reader, weights_only=True, map_location="cpu")
        if not isinstance(state, dict) or not {"policy_version", "optimizer"} <= set(state):
            raise ValueError("missing policy_version or optimizer")
        if "params" not in state:  # a full fine-tune's: they are the checkpoint's weights
            state["params"] = _folder_weights(folder)
    except Exception as e:
        raise ModelError(
            f"cannot resume from {path}: {e}. Move that checkpoint aside to resume from an "
            "earlier one, or use a new run dir to start afresh"
        ) from None
    return state


def _folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of an HF folder (one, or a sharded set)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no params in {RESUME_STATE} and no safetensors beside it")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file, device="cpu"))
    return weights


def read_checkpoint_meta(directory: Path) -> dict[str, Any]:
    path = Path(directory) / CHECKPOINT_META
    return json.loads(path.read_text()) if path.exists() else {}
