"""Repeated events logged once per interval, with their count.

A peer that sends 2,000 junk messages in a second must not write 2,000 log lines, and the
lines it does write must say how many there were:

    note(detail) ── the first in a quiet spell ──▶ logged at once: `first` (the detail)
                ── more within every_s of a line ──▶ counted, the last detail kept
    every_s after that line (a timer on the running event loop), a note past it, or
    flush() (at close) ──▶ one line: `repeated` with the count and the last detail

so the counts of the lines add up to the events noted. Without a running event loop (a
thread, plain code) the count waits for the next note or flush().
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

# A flood of one kind costs about two lines a minute; a person still sees it within 30 s.
REPEATED_LOG_EVERY_S = 30.0


class RepeatedLog:
    """One kind of event, logged by `log` at `level`: `first` ("{detail}") at once, then
    `repeated` ("{count}", "{seconds}", "{detail}": the last one's) at most every `every_s`.
    `clock` is monotonic seconds (a test's own, to step time by hand)."""

    def __init__(
        self,
        log: logging.Logger,
        first: str,
        repeated: str,
        every_s: float = REPEATED_LOG_EVERY_S,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.first = first
        self.repeated = repeated
        self.every_s = every_s
        self.level = level
        self.clock = clock
        self.noted = 0  # every event, logged or not
        self.unlogged = 0  # events since the last line
        self.last_detail = ""
        self.logged_at = -float("inf")
        self._timer: asyncio.TimerHandle | None = None

    def note(self, detail: str) -> None:
        self.noted += 1
        self.last_detail = detail
        now = self.clock()
        if self.unlogged == 0 and now - self.logged_at >= self.every_s:
            self.log.log(self.level, self.first.format(detail=detail))
            self.logged_at = now
            return
        self.unlogged += 1
        if now - self.logged_at >= self.every_s:
            self.flush()
        elif self._timer is None:
            self._flush_later(self.logged_at + self.every_s - now)

    def flush(self) -> None:
        """Log the events not yet logged, if any, with their count."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.unlogged:
            return
        now = self.clock()
        self.log.log(
            self.level,
            self.repeated.format(
                count=self.unlogged, seconds=now - self.logged_at, detail=self.last_detail
            ),
        )
        self.unlogged = 0
        self.logged_at = now

    def _flush_later(self, delay_s: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: the next note or flush() logs them
            return
        self._timer = loop.call_later(delay_s, self.flush)
