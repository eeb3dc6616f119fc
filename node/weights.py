"""Policy versions as bytes: serialize, checksum, chunk, reassemble, verify, checkpoint.

    trainer: parameters (CPU or GPU) ──to_safetensors: one host buffer──▶ PolicySnapshot(version,
             blob, sha256) ──chunks──▶ wire
    rollout: chunks ──WeightAssembly──▶ complete? sha256 ok? ──▶ state_dict ──▶ engine

A rollout node loads a version only when every chunk arrived and the checksum matches.
Tied parameters (SmolLM2 ties lm_head to the embeddings) travel once: we ship
`named_parameters()`, which lists a shared tensor under one name only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from agentjet.errors import ModelError
from agentjet.progress import CountingReader, ProgressReport

CHECKPOINT_META = "agentjet.json"
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
    version: int
    blob: bytearray  # safetensors bytes; never changed once made
    sha256: str
    chunk_bytes: int

    @property
    def num_chunks(self) -> int:
        return max(1, -(-len(self.blob) // self.chunk_bytes))

    def chunk(self, index: int) -> bytes:
        return bytes(self.blob[index * self.chunk_bytes : (index + 1) * self.chunk_bytes])


def snapshot(
    model: torch.nn.Module, version: int, chunk_bytes: int, dtype: torch.dtype | None = None
) -> PolicySnapshot:
    """The parameters that train (with LoRA: the adapters only) as one checksummed blob,
    cast to `dtype` on the way (None: as they are)."""
    tensors = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    blob = to_safetensors(tensors, {"policy_version": str(version)}, dtype)
    return PolicySnapshot(version, blob, hashlib.sha256(blob).hexdigest(), chunk_bytes)


def to_safetensors(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], dtype: torch.dtype | None = None
) -> bytearray:
    """`tensors` (on any device) in the safetensors format, each copied straight into its
    place in one host buffer: the only host copy, and no whole-model copy on a GPU (a
    cast or a non-contiguous tensor makes a temporary of that one tensor)."""
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
    blob = bytearray(8 + len(head) + offset)
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


@dataclass
class WeightAssembly:
    """Chunks of one policy version arriving in any order."""

    version: int
    nbytes: int
    sha256: str
    num_chunks: int
    chunks: dict[int, bytes] = field(default_factory=dict)

    def add(self, index: int, data: bytes) -> None:
        if not 0 <= index < self.num_chunks:
            raise ValueError(f"chunk {index} outside 0..{self.num_chunks - 1}")
        self.chunks[index] = data

    def missing(self) -> list[int]:
        return [i for i in range(self.num_chunks) if i not in self.chunks]

    def finish(self) -> dict[str, torch.Tensor]:
        """The state dict, or ValueError when incomplete or corrupt (nothing is loaded then).
        The chunks are copied into one buffer, each dropped as it is copied, and the
        tensors are views of that buffer: the version is in memory once, not three times
        (chunks, joined bytes, loaded tensors)."""
        if self.missing():
            raise ValueError(f"policy version {self.version}: {len(self.missing())} chunks missing")
        blob = bytearray()  # grows with the bytes that came, whatever size was announced
        for index in range(self.num_chunks):
            blob += self.chunks.pop(index)
        if len(blob) != self.nbytes:
            raise ValueError(f"policy version {self.version}: chunks do not add up to its size")
        if hashlib.sha256(blob).hexdigest() != self.sha256:
            raise ValueError(f"policy version {self.version}: checksum mismatch")
        return from_safetensors(blob)


def from_safetensors(blob: bytearray) -> dict[str, torch.Tensor]:
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
