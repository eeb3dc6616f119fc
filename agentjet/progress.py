"""Progress of a long operation a user waits on: a bar on a terminal, plain lines elsewhere.

    with ProgressReport("eval arithmetic", total=len(tasks), unit="tasks") as report:
        for chunk in chunks:
            play(chunk)
            report.update(len(chunk))

    terminal:  eval arithmetic [##########--------------] 20/50 tasks 40% 4.1 tasks/s ETA 7 s
               (one line redrawn in place with \\r, at most every REDRAW_S, ended by a newline)
    log, pipe: eval arithmetic: 20/50 tasks (40%), 4.1 tasks/s, ETA 7 s
               (at most every PLAIN_LINE_EVERY_S), then at the end
               eval arithmetic: 50/50 tasks in 12.3 s (4.1 tasks/s)

Used by `agentjet eval`, model downloads and conversion (node/model.py), the sandbox image
build (sandboxes/image.py) and a trainer's resume (node/weights.py). `agentjet local`'s
lines about a running swarm are another thing (agentjet_app/local.py `Progress`).
"""

from __future__ import annotations

import io
import math
import shutil
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

# A terminal's bar is redrawn at most this often: more is flicker and terminal load for nothing.
REDRAW_S = 0.1
# Without a terminal (a log file, CI, a pipe) one line at most this often, so logs stay short.
PLAIN_LINE_EVERY_S = 5.0
# Characters between the bar's brackets.
BAR_WIDTH = 24
BYTE_UNIT = "B"


class ProgressReport:
    """How far an operation got, written to `out` (default stderr, so stdout stays clean).

    `total` None is unknown (no percent, no ETA); it may be set later, once learned. Unit "B"
    shows byte counts as kB/MB/GB. Without a terminal a line comes at most every `line_every_s`
    and, at the end, "label: N/total unit in T s (R unit/s)" unless `summary` is False (the
    caller prints its own); an operation that fails ends without it (its error says why).
    `rates` False leaves out the rate and ETA, for steps of unlike length where they mislead.
    """

    def __init__(
        self,
        label: str,
        total: int | None = None,
        unit: str = "",
        out: TextIO | None = None,
        *,
        line_every_s: float = PLAIN_LINE_EVERY_S,
        summary: bool = True,
        rates: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.out = out if out is not None else sys.stderr
        self.line_every_s = line_every_s
        self.summary = summary
        self.rates = rates
        self.clock = clock
        self.done = 0
        self.note = ""
        self.tty = self.out.isatty()
        self.started = clock()
        self._last_shown = self.started
        self._drawn_width = 0
        self._closed = False
        if self.tty:
            self._draw()

    def __enter__(self) -> ProgressReport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(failed=exc_type is not None)

    def update(self, n: int = 1, note: str | None = None) -> None:
        """Add `n` done; `note` (what it does now) replaces the previous one."""
        was_finished = self._finished()
        self.done += n
        if note is not None:
            self.note = note
        if self._closed:
            return
        now = self.clock()
        if self.tty:
            # The update that reaches the total is drawn, whatever the time: a bar that stops
            # short of its end looks stuck.
            if now - self._last_shown >= REDRAW_S or (self._finished() and not was_finished):
                self._draw()
        elif now - self._last_shown >= self.line_every_s and not self._finished():
            self._last_shown = now
            self._write(f"{self.label}: {self._line(now)}\n")

    def close(self, failed: bool = False) -> None:
        """End the report: the bar's last state and a newline, or the summary line."""
        if self._closed:
            return
        self._closed = True
        if self.tty:
            self._draw(final=True)
            self._write("\n")
        elif self.summary and not failed:
            elapsed = self._elapsed(self.clock())
            rate = self._rate(elapsed)
            rate = f" ({rate})" if rate else ""
            self._write(f"{self.label}: {self._counts()} in {elapsed:.1f} s{rate}\n")

    def _finished(self) -> bool:
        return self.total is not None and self.done >= self.total

    def _elapsed(self, now: float) -> float:
        return max(0.0, now - self.started)

    def _counts(self) -> str:
        counts = self._amount(self.done)
        if self.total is not None:
            counts += "/" + self._amount(self.total)
        return counts if self.unit == BYTE_UNIT else _words(counts, self.unit)

    def _amount(self, n: int) -> str:
        return _bytes(n) if self.unit == BYTE_UNIT else str(n)

    def _rate(self, elapsed: float) -> str:
        """'4.1 tasks/s', '0.023 steps/s', '12.0 MB/s'; '' without `rates`."""
        if not self.rates:
            return ""
        per_s = self.done / elapsed if elapsed > 0 else 0.0
        if self.unit == BYTE_UNIT:
            return f"{_bytes(per_s)}/s"
        figure = f"{per_s:.1f}" if per_s >= 1 or per_s == 0 else f"{per_s:.2g}"
        return _words(figure, self.unit) + "/s"

    def _percent(self) -> float | None:
        if self.total is None:
            return None
        return 100.0 if self.total <= 0 else min(100.0, 100.0 * self.done / self.total)

    def _eta(self, elapsed: float) -> str:
        """'ETA 7 s' when the total is known and something is done; '' otherwise."""
        if not self.rates or self.total is None or self.done <= 0 or elapsed <= 0:
            return ""
        left_s = max(0, self.total - self.done) * elapsed / self.done
        return f"ETA {_duration(left_s)}"

    def _line(self, now: float) -> str:
        """The parts of a plain line after the label: counts (percent), note, rate, ETA."""
        elapsed = self._elapsed(now)
        percent = self._percent()
        counts = self._counts() + (f" ({percent:.0f}%)" if percent is not None else "")
        rate = self._rate(elapsed) if self.done > 0 else ""
        return ", ".join(part for part in (counts, self.note, rate, self._eta(elapsed)) if part)

    def _draw(self, final: bool = False) -> None:
        now = self.clock()
        self._last_shown = now
        elapsed = self._elapsed(now)
        percent = self._percent()
        bar = ""
        if percent is not None:
            filled = round(BAR_WIDTH * percent / 100)
            bar = "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]"
        figures = [self._counts(), f"{percent:.0f}%" if percent is not None else ""]
        figures.append(self._rate(elapsed) if self.done > 0 else "")
        figures += [f"in {elapsed:.1f} s" if final else self._eta(elapsed), self.note]
        # A line wider than the terminal wraps, and \r then redraws only its last part: the
        # bar goes first, then the end of the line.
        width = max(20, shutil.get_terminal_size().columns - 1)
        text = " ".join(part for part in [self.label, bar, *figures] if part)
        if len(text) > width:
            text = " ".join(part for part in [self.label, *figures] if part)[:width]
        padding = " " * max(0, self._drawn_width - len(text))
        self._drawn_width = len(text)
        self._write(f"\r{text}{padding}")

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


class CountingReader(io.RawIOBase):
    """A binary file that reports each read's byte count to `on_read` (a report's `update`),
    for libraries that read a file they are handed (torch.load)."""

    def __init__(self, file: io.BufferedIOBase, on_read: Callable[[int], object]) -> None:
        super().__init__()
        self.file = file
        self.on_read = on_read

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def read(self, size: int | None = -1) -> bytes:
        data = self.file.read(size)
        self.on_read(len(data))
        return data

    def readinto(self, buffer: WriteableBuffer) -> int:
        n = self.file.readinto(buffer)
        self.on_read(n)
        return n


def _words(count: str, unit: str) -> str:
    return f"{count} {unit}" if unit else count


def _bytes(n: float) -> str:
    """A byte count or rate in decimal units: 512 B, 3.4 kB, 120.0 MB, 1.6 GB."""
    for scale, suffix in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {suffix}"
    return f"{n:.0f} B"


def _duration(seconds: float) -> str:
    """7 s, 2 min 5 s, 1 h 3 min: precise enough for an estimate."""
    seconds = math.ceil(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"
