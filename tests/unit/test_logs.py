"""Repeated events logged once per interval with their count (agentjet/logs.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agentjet.logs import RepeatedLog

pytestmark = pytest.mark.unit

FIRST = "refused a message: {detail}"
REPEATED = "refused {count} more in the last {seconds:.0f} s; the last: {detail}"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    shown = [r.getMessage() for r in caplog.records if r.name == "test-logs"]
    caplog.clear()
    return shown


def test_a_flood_is_one_line_then_its_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    repeated = RepeatedLog(logging.getLogger("test-logs"), FIRST, REPEATED, 30.0, clock=clock)

    repeated.note("a")  # t=0, the first of a quiet spell: at once
    assert lines(caplog) == ["refused a message: a"]
    for t, detail in ((1, "b"), (2, "c"), (3, "d"), (4, "e"), (5, "f")):
        clock.now = t
        repeated.note(detail)
    assert lines(caplog) == []  # no event loop here: no timer, counted only
    clock.now = 10.0
    repeated.flush()
    assert lines(caplog) == ["refused 5 more in the last 10 s; the last: f"]

    clock.now = 12.0
    repeated.note("g")  # 2 s after a line: counted
    clock.now = 45.0
    repeated.note("h")  # 35 s after it: due, logged with the one before
    assert lines(caplog) == ["refused 2 more in the last 35 s; the last: h"]

    clock.now = 100.0
    repeated.note("i")  # a quiet spell again: at once
    repeated.flush()  # nothing unlogged: no line
    assert lines(caplog) == ["refused a message: i"]
    assert repeated.noted == 1 + 5 + 2 + 1


def test_the_count_comes_out_on_time_without_another_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    every_s = 0.05

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        counted = asyncio.Event()

        class Seen(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "more" in record.getMessage():
                    counted.set()

        logger = logging.getLogger("test-logs")
        seen = Seen()
        logger.addHandler(seen)
        try:
            repeated = RepeatedLog(logger, FIRST, REPEATED, every_s, clock=loop.time)
            for detail in ("a", "b", "c"):
                repeated.note(detail)
            await asyncio.wait_for(counted.wait(), timeout=5.0)
        finally:
            logger.removeHandler(seen)

    asyncio.run(scenario())
    first, summary = lines(caplog)
    assert first == "refused a message: a"
    assert summary.startswith("refused 2 more in the last 0 s") and summary.endswith("the last: c")
