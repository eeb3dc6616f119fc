"""A rollout node's on-disk copy of every group no trainer has trained yet.

    Ledger.add ──▶ put: <spool>/<sha256(group id)>.group  (written to a temp file, fsynced,
                        renamed: a crash leaves the old state or the new, never half a file)
    a trainer accepts it ──▶ hold: <name>.holder names that trainer
    trained / dropped / final reply ──▶ remove (both files)
    restart ──▶ load: every group back, with the trainer that held it, if one did

A restarted node offers a group that a trainer held to that trainer only (it answers
"duplicate" or "unknown"), never to another while that one lives: the group may be in
its queue, and two trainers would both train it.

The spool is capped in bytes (`rollout.spool_max_bytes`): a node whose spool is full stops
generating until trainers catch up, and says so. A file that does not decode (a damaged
disk, a hand edit) is renamed to `*.corrupt`, logged and counted, never loaded again and
never deleted. One node owns a spool at a time: a second one pointed at it refuses to start.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import msgspec

from agentjet import protocol
from agentjet.rundir import hold

log = logging.getLogger(__name__)

_decoder = msgspec.msgpack.Decoder(protocol.TrajectoryGroup)
# A trainer id is short (hostname, pid, a suffix); a longer .holder file is not ours.
MAX_HOLDER_BYTES = 256


class SpoolFull(Exception):
    """Writing one more group would take the spool over its byte cap."""


class Spool:
    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        # The run dir's lock holds a spool within it; this one, one set elsewhere too.
        self._hold = hold(
            self.directory / "spool.lock",
            "rollout",
            "",
            f"spool {self.directory}",
            "give each rollout node its own run dir (--run-dir) or rollout.spool_dir",
        )
        self.sizes: dict[str, int] = {}  # file name -> bytes, for every spooled group
        self.nbytes = 0  # their sum (asked before every batch and every write)
        self.holders: dict[str, str] = {}  # file name -> the trainer its .holder names
        self.corrupt = 0

    def full(self) -> bool:
        return self.nbytes >= self.max_bytes

    def load(self) -> list[tuple[protocol.TrajectoryGroup, str | None]]:
        """Every group spooled by an earlier run of this node, oldest first, with the id of
        the trainer that held it (None: none accepted it)."""
        groups = []
        paths = sorted(self.directory.glob("*.group"), key=lambda p: p.stat().st_mtime)
        for path in paths:
            data = path.read_bytes()
            try:
                group = _decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.corrupt += 1
                path.rename(path.with_suffix(".corrupt"))
                log.error("spooled file %s does not decode (%s); kept as .corrupt", path, e)
                continue
            if path.name != _file_name(group.group_id):
                self.corrupt += 1
                path.rename(path.with_suffix(".corrupt"))
                log.error("spooled file %s holds group %r; kept as .corrupt", path, group.group_id)
                continue
            self.nbytes += len(data) - self.sizes.get(path.name, 0)
            self.sizes[path.name] = len(data)
            holder = self._holder(path)
            if holder is not None:
                self.holders[path.name] = holder
            groups.append((group, holder))
        for stale_tmp in self.directory.glob("*.tmp"):  # a write cut short by a crash
            stale_tmp.unlink()
        for orphan in self.directory.glob("*.holder"):  # its group was removed first
            if orphan.with_suffix(".group").name not in self.sizes:
                orphan.unlink()
        return groups

    def _holder(self, path: Path) -> str | None:
        holder = path.with_suffix(".holder")
        if not holder.exists():
            return None
        name = holder.read_bytes()[:MAX_HOLDER_BYTES].decode(errors="replace").strip()
        return name or None

    def put(self, group: protocol.TrajectoryGroup) -> None:
        """Write `group` durably; raises SpoolFull (and writes nothing) past the cap."""
        data = protocol.encode(group)
        name = _file_name(group.group_id)
        if self.nbytes - self.sizes.get(name, 0) + len(data) > self.max_bytes:
            raise SpoolFull(
                f"spool {self.directory} is full ({self.nbytes / 2**20:.1f} MiB of "
                f"{self.max_bytes / 2**20:.1f} MiB): trainers are not taking groups; raise "
                "rollout.spool_max_bytes or add trainers"
            )
        tmp = self.directory / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / name)
        self.nbytes += len(data) - self.sizes.get(name, 0)
        self.sizes[name] = len(data)

    def hold(self, group_id: str, trainer_id: str) -> None:
        """Note that `trainer_id` accepted the group (atomic; no fsync: a crash that loses
        the note leaves a window as short as the write)."""
        name = _file_name(group_id)
        if name not in self.sizes or self.holders.get(name) == trainer_id:
            return  # (offered, then accepted by that trainer: written once)
        self.holders[name] = trainer_id
        path = (self.directory / name).with_suffix(".holder")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(trainer_id[:MAX_HOLDER_BYTES])
        os.replace(tmp, path)

    def remove(self, group_id: str) -> None:
        name = _file_name(group_id)
        size = self.sizes.pop(name, None)
        self.holders.pop(name, None)
        if size is not None:
            self.nbytes -= size
            (self.directory / name).with_suffix(".holder").unlink(missing_ok=True)
            (self.directory / name).unlink(missing_ok=True)

    def close(self) -> None:
        self._hold.release()


def _file_name(group_id: str) -> str:
    """Group ids come from the coordinator: hashed, they cannot name a path elsewhere."""
    return hashlib.sha256(group_id.encode()).hexdigest()[:32] + ".group"
