"""Metrics as JSON lines: one file per role under <run dir>/metrics/, one object per event.

Keys are namespaced (`charts/…`, `losses/…`, `perf/…`) as in cleanrl; every row carries
`time` (unix seconds) and `role`.
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, run_dir: str | Path, role: str) -> None:
        self.role = role
        self.path = Path(run_dir) / "metrics" / f"{role}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered so readers see whole rows; held open for the role's lifetime.
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps({"time": time.time(), "role": self.role, **row}) + "\n")

    def close(self) -> None:
        self._file.close()


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
        while self.intervals[0][1] < end - self.window_s:
            self.intervals.popleft()
        span = end - min(s for s, _, _ in self.intervals)
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
