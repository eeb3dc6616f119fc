"""What a trainer's log shows of hivemind's expected failures: one line and counts, not a
traceback each (issue 47: 114 "Task exception was never retrieved" tracebacks per trainer
under load buried the real messages)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from hivemind.utils.mpfuture import MPFuture

from node import dht
from node.dht import ExpectedSwarmErrors

pytestmark = pytest.mark.unit


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.addFilter(ExpectedSwarmErrors())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _hivemind_timeout() -> TimeoutError:
    """A TimeoutError raised in hivemind's code, as its waits raise them."""
    try:
        MPFuture().result(timeout=0)
    except TimeoutError as e:
        return e
    raise AssertionError("no timeout")


@pytest.fixture
def lines() -> Iterator[_Lines]:
    handler, second = _Lines(), _Lines()  # (a record passes every handler's filter)
    root = logging.getLogger()
    root.addHandler(handler)
    root.addHandler(second)
    dht._task_ends.logged_at = -float("inf")  # a quiet spell before each test
    dht._task_ends.unlogged = 0
    yield handler
    root.removeHandler(handler)
    root.removeHandler(second)


def test_hivemind_tasks_that_time_out_are_one_line_then_a_count(lines: _Lines) -> None:
    error = _hivemind_timeout()
    for _ in range(100):
        logging.getLogger("asyncio").error(
            "Task exception was never retrieved",
            exc_info=(type(error), error, error.__traceback__),
        )
    dht._task_ends.flush()
    shown = [(r.name, r.levelno, r.getMessage()) for r in lines.records]
    assert [(name, level) for name, level, _ in shown] == [
        ("node.dht", logging.WARNING),
        ("node.dht", logging.WARNING),
    ], shown
    assert "a hivemind task ended with TimeoutError" in shown[0][2]
    assert shown[1][2].startswith("99 more hivemind tasks ended with a timeout")


def test_other_errors_keep_their_traceback(lines: _Lines) -> None:
    try:
        raise TimeoutError("a timeout of this project's own")
    except TimeoutError as e:
        logging.getLogger("asyncio").error("Task exception was never retrieved", exc_info=e)
    (record,) = [r for r in lines.records if r.name == "asyncio"]
    assert record.levelno == logging.ERROR and record.exc_info is not None
