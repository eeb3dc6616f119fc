"""What the dashboard reads of a run dir, incrementally and bounded.

    metrics/<role>.jsonl ──read_rows(offset)──▶ the complete rows after a byte offset and
                                                the next offset (a torn last line waits
                                                for its newline)
    metrics/<role>.jsonl ──node_row──────────▶ one row of the nodes table (the file's tail)
    trajectories.jsonl ───TrajectoryIndex────▶ summaries of the newest groups, and where
                                                each group's line is, read on demand

Files only grow while a run writes them; a trajectory file that shrank or was replaced is
indexed again from the start. Every read is bounded in bytes and rows, so a long run costs
a reply no more than a short one. Imports no torch and nothing of node/: the dashboard
runs anywhere the run dir is.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Names that may appear in a request: a role (a metrics file's stem), a group id, an env.
ROLE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
GROUP_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
ENV_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")

# Rows one metrics reply holds at most: a browser parses a reply in one go.
MAX_ROWS_PER_REPLY = 2000
# Bytes one metrics reply reads at most; a single row longer than this is skipped.
MAX_READ_BYTES = 4 << 20
# How much of a metrics file's end the nodes table reads (a trainer step row is ~3 KB).
TAIL_BYTES = 256 << 10
# Trajectory groups the index keeps, the newest; older ones leave the viewer's list.
MAX_INDEXED_GROUPS = 2000
# A trajectory file's first scan starts at most this far before its end (recent groups
# are what a user opens; a long run's file may hold gigabytes).
MAX_SCAN_BYTES = 64 << 20
# One group's line at most (an agent group with long merged timelines is about 1 MB);
# also what one refresh of the index reads at most, so it never stalls the server.
MAX_GROUP_BYTES = 32 << 20
# Block size when looking for the end of a line too long to read whole.
SCAN_BLOCK_BYTES = 1 << 20
# Keys of a role's rows that say how much work it holds, by role (the first one present).
QUEUE_KEYS = ("queue", "unacked", "coordinator/leases_open")
# Prefixes and keys of memory and GPU figures (node/gpu_monitor.py, agentjet/devices.py).
MEMORY_PREFIXES = ("gpu/", "mem/", "memory/")
MEMORY_KEYS = ("perf/gpu_peak_mb",)
# A trainer's counts of gradient rounds with its peers (node/swarm.py SwarmOptimizer.counts),
# by the nodes table's column.
ROUND_KEYS = {
    "failed": "counts/swarm_failed_rounds",
    "partial": "counts/swarm_partial_rounds",
    "repaired": "counts/swarm_repairs",
}
# Quarantined node ids one row of the nodes table lists at most.
MAX_QUARANTINED_SHOWN = 50


class BadOffset(ValueError):
    """A metrics offset that is not the start of a row of the file."""


def decode_row(line: bytes) -> dict[str, Any] | None:
    """One JSON object, or None for a line that is not one (torn, or appended to after a
    power cut). NaN and infinities become null: browsers' JSON has no such numbers."""
    try:
        value = json.loads(line, parse_constant=lambda _: None, parse_float=_finite)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _finite(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None  # 1e999


@dataclass(frozen=True)
class Rows:
    rows: list[dict[str, Any]]
    next_offset: int  # where the next read starts: after the last complete line taken
    size: int  # the file's size when read
    skipped: int  # lines that were not a JSON object
    more: bool  # the reply was cut short by its bounds: complete rows wait past next_offset


def read_rows(
    path: Path,
    offset: int,
    max_rows: int = MAX_ROWS_PER_REPLY,
    max_bytes: int = MAX_READ_BYTES,
) -> Rows:
    """The complete rows of `path` after byte `offset` (0, or just past a newline)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if offset > size:
            raise BadOffset(f"offset {offset} is past the end of the file ({size} bytes)")
        if offset > 0:
            f.seek(offset - 1)
            if f.read(1) != b"\n":
                raise BadOffset(f"offset {offset} is not at the start of a row")
        data = f.read(max_bytes)
    rows: list[dict[str, Any]] = []
    skipped = pos = 0
    while len(rows) < max_rows:
        end = data.find(b"\n", pos)
        if end < 0:
            break
        row = decode_row(data[pos:end])
        if row is None:
            skipped += 1
        else:
            rows.append(row)
        pos = end + 1
    if pos == 0 and len(data) == max_bytes:  # one line longer than a reply: skip it
        newline = find_newline(path, offset + len(data))
        if newline is not None:
            return Rows([], newline + 1, size, 1, more=True)
    bounded = len(rows) == max_rows or len(data) == max_bytes
    return Rows(rows, offset + pos, size, skipped, more=bounded and offset + pos < size)


def find_newline(path: Path, start: int) -> int | None:
    """The position of the first newline of `path` at or after `start`, if there is one."""
    with open(path, "rb") as f:
        f.seek(start)
        at = start
        while block := f.read(SCAN_BLOCK_BYTES):
            found = block.find(b"\n")
            if found >= 0:
                return at + found
            at += len(block)
    return None


def tail_rows(path: Path, nbytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The complete rows in the last `nbytes` of `path`, oldest first."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = max(size - nbytes, 0)
        f.seek(start)
        data = f.read(nbytes)
    if start > 0:  # the first line is cut: begin after it
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
    complete = data[: data.rfind(b"\n") + 1]
    return [row for line in complete.splitlines() if (row := decode_row(line)) is not None]


def node_row(role: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One role's line of the nodes table: each figure from the newest row that has it."""

    def newest(*keys: str) -> Any:
        for row in reversed(rows):
            for key in keys:
                if _is_number(row.get(key)):
                    return row[key]
        return None

    memory: dict[str, float] = {}
    quarantined: set[str] = set()
    for row in rows:  # oldest first: newer values win
        for key, value in row.items():
            if (key.startswith(MEMORY_PREFIXES) or key in MEMORY_KEYS) and _is_number(value):
                memory[key] = value
        quarantined |= quarantined_in(row)
        if row.get("event") == "quarantine_lifted":  # (node/verify.py: lifted after a while)
            quarantined.discard(row.get("node_id"))  # type: ignore[arg-type]
    last = rows[-1] if rows else {}
    return {
        "role": role,
        "policy_version": newest("policy_version"),
        "queue": newest(*QUEUE_KEYS),
        "samples_per_s": newest("perf/samples_per_s"),
        "time": newest("time"),
        "event": last.get("event") if isinstance(last.get("event"), str) else None,
        "memory": memory,
        **{f"rounds_{name}": newest(key) for name, key in ROUND_KEYS.items()},
        "quarantined": sorted(quarantined)[:MAX_QUARANTINED_SHOWN],
        "quarantined_count": newest("counts/nodes_quarantined"),
    }


def quarantined_in(row: dict[str, Any]) -> set[str]:
    """The nodes a trainer's row says it quarantined: an `event: quarantined` row names
    one, its `stopped` row lists them all."""
    if row.get("event") == "quarantined" and isinstance(row.get("node_id"), str):
        return {row["node_id"]}
    listed = row.get("quarantined")
    if isinstance(listed, list):
        return {node for node in listed if isinstance(node, str)}
    return set()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class GroupEntry:
    summary: dict[str, Any]
    offset: int  # where its line starts in the file
    length: int  # its line's length, without the newline


def group_summary(group: dict[str, Any]) -> dict[str, Any] | None:
    """What the viewer's list shows of a group, or None for a line that is no group."""
    group_id = group.get("group_id")
    samples = group.get("samples")
    if not isinstance(group_id, str) or not GROUP_ID_PATTERN.fullmatch(group_id):
        return None
    if not isinstance(samples, list):
        return None

    def text(key: str) -> str:
        value = group.get(key)
        return value if isinstance(value, str) else ""

    rewards = [
        s.get("reward") if isinstance(s, dict) and _is_number(s.get("reward")) else None
        for s in samples
    ]
    version = group.get("policy_version")
    time = group.get("time")
    return {
        "group_id": group_id,
        "time": time if _is_number(time) else None,
        "env": text("env"),
        "task_id": text("task_id"),
        "node_id": text("node_id"),
        "policy_version": version if _is_number(version) else None,
        "rewards": rewards,
    }


class TrajectoryIndex:
    """The newest groups of a trajectories.jsonl (newest last in the file), by group id.

    `refresh()` reads what was appended since the last call, at most MAX_GROUP_BYTES; a
    later call goes on from there. A group written twice is listed once, as written last.
    """

    def __init__(self, path: Path, max_groups: int = MAX_INDEXED_GROUPS) -> None:
        self.path = path
        self.max_groups = max_groups
        self.groups: OrderedDict[str, GroupEntry] = OrderedDict()  # oldest first
        self.skipped = 0  # lines that were no group, or too long to keep
        self.offset = 0
        self._file_id: tuple[int, int] | None = None

    def refresh(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._reset(None)
            return
        file_id = (stat.st_dev, stat.st_ino)
        if file_id != self._file_id or stat.st_size < self.offset:
            self._reset(file_id)
            if stat.st_size > MAX_SCAN_BYTES:
                newline = find_newline(self.path, stat.st_size - MAX_SCAN_BYTES)
                self.offset = stat.st_size if newline is None else newline + 1
        if stat.st_size == self.offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(MAX_GROUP_BYTES)
        pos = 0
        while (end := data.find(b"\n", pos)) >= 0:
            self._add(data[pos:end], self.offset + pos)
            pos = end + 1
        if pos == 0 and len(data) == MAX_GROUP_BYTES:  # a line longer than any group
            newline = find_newline(self.path, self.offset + len(data))
            if newline is not None:
                self.skipped += 1
                pos = newline + 1 - self.offset
        self.offset += pos

    def _reset(self, file_id: tuple[int, int] | None) -> None:
        self.groups.clear()
        self.offset = 0
        self._file_id = file_id

    def _add(self, line: bytes, offset: int) -> None:
        group = decode_row(line)
        summary = group_summary(group) if group is not None else None
        if summary is None:
            self.skipped += 1
            return
        self.groups.pop(summary["group_id"], None)
        self.groups[summary["group_id"]] = GroupEntry(summary, offset, len(line))
        while len(self.groups) > self.max_groups:
            self.groups.popitem(last=False)

    def newest(self, limit: int, env: str = "") -> list[dict[str, Any]]:
        """Up to `limit` summaries, newest first, of `env`'s groups (every env's for "")."""
        found: list[dict[str, Any]] = []
        for entry in reversed(self.groups.values()):
            if len(found) == limit:
                break
            if not env or entry.summary["env"] == env:
                found.append(entry.summary)
        return found

    def envs(self) -> list[str]:
        return sorted({entry.summary["env"] for entry in self.groups.values()})

    def read(self, group_id: str) -> dict[str, Any] | None:
        """The whole group as written, or None when it is not (or no longer) in the file."""
        entry = self.groups.get(group_id)
        if entry is None:
            return None
        with open(self.path, "rb") as f:
            f.seek(entry.offset)
            group = decode_row(f.read(entry.length))
        if group is None or group.get("group_id") != group_id:  # the file was replaced
            return None
        return group
