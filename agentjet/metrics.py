"""Metrics: one writer per role; every row to a JSON lines file, numbers to trackers.

    role ──write(row)──▶ MetricsWriter ──▶ <run dir>/metrics/<role>.jsonl    every row, as is
                                     ├──▶ trackers ([log] backends)         numbers only
                                     │      tensorboard: <run dir>/tensorboard/<role>/
                                     │      wandb, trackio: one tracker run per role
                                     └──▶ RecentRows (in memory, the newest RECENT_ROWS)
                                            ◀── MetricsRequest(since) from the dashboard

Keys are namespaced (`charts/…`, `losses/…`, `perf/…`) as in cleanrl; every row carries
`time` (unix seconds) and `role`. A tracker gets a row's finite ints and floats (not
bools, strings, lists or tables) under their key, a key without a namespace under
`<role>/<key>` (`trainer/queue`), at step = the row's `policy_version` (else the role's
latest one; a role without versions, the coordinator, counts its rows) and at the row's
`time`, so TensorBoard's wall-time axis lines the roles up.

A tracker that raises (full disk, network) is a fault-tolerance boundary: one warning, a
`tracker_failed` row in the JSONL, and the tracker is dropped for the rest of the run (a
retry would pay a network timeout or a disk error on every row); the role never sees it.
Tracker packages are imported only when asked for; this module never imports torch (the
coordinator uses it).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import math
import os
import socket
import time
from collections import deque
from pathlib import Path
from typing import Any, Protocol

from agentjet.config import LogConfig
from agentjet.errors import ConfigError
from agentjet.protocol import Error, MetricsRequest, MetricsRows

log = logging.getLogger(__name__)

# Row keys that are the trackers' axes (wall time, step), not values to plot.
AXIS_KEYS = frozenset({"time", "policy_version"})
# What `pip install` needs for each backend.
BACKEND_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
# Rows a role keeps in memory for MetricsRequest: a trainer's step row is ~3 KB, so about
# 3 MB; the dashboard polls every few seconds, and older rows are in the JSONL file.
RECENT_ROWS = 1000
# Bytes of rows one MetricsRows reply carries at most (a row longer than this goes alone):
# far under net.max_message_bytes, and a reply the role encodes in a millisecond.
MAX_ROWS_REPLY_BYTES = 1 << 20


class Tracker(Protocol):
    """Where a role's numbers go besides its JSONL file."""

    def log(self, scalars: dict[str, float], step: int, wall_time: float) -> None: ...

    def close(self) -> None: ...


class MetricsWriter:
    def __init__(self, run_dir: str | Path, role: str, config: LogConfig | None = None) -> None:
        self.role = role
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics" / f"{role}.jsonl"
        config = config if config is not None else LogConfig()
        backends = list(dict.fromkeys(config.backends))
        for backend in backends:
            _require(backend)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.recent = RecentRows()  # what the role answers MetricsRequest with
        # Line-buffered so readers see whole rows; held open for the role's lifetime.
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115
        # Trackers that failed, and how: each cost one warning and a "tracker_failed" row.
        self.failed: dict[str, str] = {}
        self._trackers: dict[str, Tracker] = {}
        for backend in backends:
            try:
                self._trackers[backend] = _open_tracker(backend, self.run_dir, role, config)
            except Exception as e:  # a tracker's own start: its disk, its network
                self._fail(backend, e)
        self._rows = 0
        self._version: int | None = None

    def write(self, row: dict[str, Any]) -> None:
        record = self._append(row)
        if self._trackers:
            self._track(record)

    def _track(self, record: dict[str, Any]) -> None:
        step = self._step(record)
        scalars = tracker_scalars(record, self.role)
        if not scalars:
            return
        for backend, tracker in list(self._trackers.items()):
            try:
                tracker.log(scalars, step, record["time"])
            except Exception as e:  # a tracker's disk or network: never the role's problem
                # Dropped, not closed: closing a tracker whose network is gone can block
                # for as long as it retries its uploads.
                del self._trackers[backend]
                self._fail(backend, e)

    def close(self) -> None:
        """Flush and close every tracker and the JSONL file; a failure is only logged."""
        for backend, tracker in self._trackers.items():
            _close_quietly(backend, tracker)
        self._trackers.clear()
        try:
            self._file.close()
        except OSError as e:
            log.warning("metrics: closing %s failed: %s", self.path, e)

    def _append(self, row: dict[str, Any]) -> dict[str, Any]:
        record = {"time": time.time(), "role": self.role, **row}
        text = json.dumps(record)
        self._file.write(text + "\n")
        self.recent.add(text)
        return record

    def _step(self, record: dict[str, Any]) -> int:
        """The row's policy version, else the role's latest one, else the rows written."""
        self._rows += 1
        version = record.get("policy_version")
        if isinstance(version, int) and not isinstance(version, bool):
            self._version = version
        return self._version if self._version is not None else self._rows - 1

    def _fail(self, backend: str, error: Exception) -> None:
        what = f"{type(error).__name__}: {error}"
        self.failed[backend] = what
        log.warning(
            "metrics: the %s tracker failed (%s); it gets no more rows this run, "
            "%s still gets every row",
            backend,
            what,
            self.path,
        )
        self._append({"event": "tracker_failed", "backend": backend, "error": what})


class RecentRows:
    """The newest rows a role wrote, as JSON text, at most `capacity` of them.

    Rows are numbered from 0 in writing order; `answer` serves a MetricsRequest from row
    `since` on, which is how the dashboard follows a live role without reading its disk.
    Written and read on the role's event loop only.
    """

    def __init__(self, capacity: int = RECENT_ROWS) -> None:
        self.rows: deque[str] = deque(maxlen=capacity)
        self.written = 0

    def add(self, text: str) -> None:
        self.rows.append(text)
        self.written += 1

    def answer(
        self, request: MetricsRequest, max_bytes: int = MAX_ROWS_REPLY_BYTES
    ) -> MetricsRows | Error:
        """The rows from `request.since` on, as many as fit in `max_bytes`."""
        since = request.since
        if not 0 <= since <= self.written:
            return Error(
                code="invalid",
                message=f"since={since}: this role has written rows 0 to {self.written - 1}; "
                "ask from 0, then from each reply's `next`",
            )
        first = self.written - len(self.rows)  # the oldest row still held
        start = max(since, first)
        rows: list[str] = []
        size = 0
        for text in itertools.islice(self.rows, start - first, None):
            if rows and size + len(text) > max_bytes:
                break
            rows.append(text)
            size += len(text)
        return MetricsRows(
            rows=rows, next=start + len(rows), written=self.written, dropped=start - since
        )


class Rate:
    """Counts per second over the last `window_s` seconds of intervals, for progress output.

    A trainer step that finds its batch waiting (all groups zero-variance: no gradient to
    compute) ends within milliseconds; its own count over its own time would show thousands
    of samples per second.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.intervals: deque[tuple[float, float, float]] = deque()  # (start, end, count)

    def add(self, start: float, end: float, count: float) -> float:
        """Record `count` over [start, end]; returns the rate over the window ending now."""
        self.intervals.append((start, end, count))
        return self.at(end)

    def at(self, now: float) -> float:
        """The rate over the window ending at `now`: idle time since the last interval
        counts, so an idle worker's rate falls, and is 0 once the window holds nothing."""
        while self.intervals and self.intervals[0][1] < now - self.window_s:
            self.intervals.popleft()
        if not self.intervals:
            return 0.0
        span = now - min(s for s, _, _ in self.intervals)
        return sum(c for _, _, c in self.intervals) / span if span > 0 else 0.0


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete rows of a metrics file (a torn last line from a live writer is skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def tracker_scalars(row: dict[str, Any], role: str) -> dict[str, float]:
    """The numbers of a metrics row a tracker plots, by tag: finite ints and floats (not
    bools), under their key, or `<role>/<key>` for a key without a namespace."""
    scalars = {}
    for key, value in row.items():
        number = _plottable(value)
        if key not in AXIS_KEYS and number is not None:
            scalars[key if "/" in key else f"{role}/{key}"] = number
    return scalars


def _plottable(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        return None
    return number if math.isfinite(number) else None


def _require(backend: str) -> None:
    """A backend the config names must be installed: say what to install, at start."""
    package = BACKEND_PACKAGES[backend]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"config error at log.backends: {backend!r} needs the {package} package "
            f"(pip install {package}), or leave it out of log.backends"
        )


def _open_tracker(backend: str, run_dir: Path, role: str, config: LogConfig) -> Tracker:
    # The group of a tracker run: every role of one run dir (or of one swarm, when set).
    group = config.group or run_dir.resolve().name
    if backend == "tensorboard":
        return TensorBoardTracker(run_dir / "tensorboard" / role)
    if backend == "wandb":
        return WandbTracker(config.project, group, role, run_dir)
    return TrackioTracker(config.project, group, role)


def _close_quietly(backend: str, tracker: Tracker) -> None:
    try:
        tracker.close()
    except Exception as e:  # shutting down: the rows are in the JSONL either way
        log.warning("metrics: closing the %s tracker failed: %s", backend, e)


# Tells apart the event files of writers one process opens in the same second.
_event_files = itertools.count()


class TensorBoardTracker:
    """Event files TensorBoard reads, written with the tensorboard package alone (no torch,
    no TensorFlow, no writer thread). Each row is one event, appended and closed before
    `log` returns: TensorBoard sees it at once, and a log dir that is full, gone or made
    unwritable fails on the row that meets it instead of losing rows unnoticed."""

    def __init__(self, directory: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event_pb2 = event_pb2
        self._summary_pb2 = summary_pb2
        self._record_writer = RecordWriter
        directory.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads the files whose names hold "tfevents", in name order.
        self.path = directory / (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
            f".{os.getpid()}.{next(_event_files)}"
        )
        self._append(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def log(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        values = [
            self._summary_pb2.Summary.Value(tag=tag, simple_value=value)
            for tag, value in scalars.items()
        ]
        summary = self._summary_pb2.Summary(value=values)
        self._append(self._event_pb2.Event(wall_time=wall_time, step=step, summary=summary))

    def close(self) -> None:
        """Nothing held open: every row is on disk once `log` returns."""

    def _append(self, event: Any) -> None:
        with open(self.path, "ab") as f:
            self._record_writer(f).write(event.SerializeToString())


class WandbTracker:
    """A wandb run per role, named after it, grouped with the run's other roles."""

    def __init__(self, project: str, group: str, role: str, run_dir: Path) -> None:
        import wandb

        self._run = wandb.init(
            project=project, group=group, name=role, job_type=role, dir=str(run_dir)
        )
        self._step = 0

    def log(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        # wandb drops (with a warning) a row whose step is below one it has seen; a row
        # that lags the role's latest version goes in at that version instead.
        self._step = max(self._step, step)
        self._run.log(scalars, step=self._step)

    def close(self) -> None:
        self._run.finish()


class TrackioTracker:
    """A trackio run per role, named after it, grouped with the run's other roles."""

    def __init__(self, project: str, group: str, role: str) -> None:
        import trackio

        self._run = trackio.init(project=project, name=role, group=group)

    def log(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
