"""A role's background loops end when it stops, whatever they were waiting on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop

from agentjet.roles import supervise, wait_for

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
Waiter = Callable[[Awaitable[Any], float], Awaitable[Any]]


async def stop_as_the_event_fires(waiter: Waiter) -> bool:
    """A loop like the rollout node's (wait for an event, or poll after a while) is told to
    stop in the same loop iteration as its event fires; whether `supervise` returns."""
    event, stop = asyncio.Event(), asyncio.Event()

    async def loop() -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await waiter(event.wait(), 60)
            event.clear()

    async def signal_then_reply() -> None:
        await asyncio.sleep(0)  # the loop is waiting
        stop.set()  # SIGTERM ...
        event.set()  # ... and a peer's reply, handled in the same iteration

    asyncio.get_running_loop().call_soon(asyncio.ensure_future, signal_then_reply())
    try:
        async with asyncio.timeout(2):  # it returns at once, or never
            await supervise(stop, {"loop": loop()})
    except TimeoutError:
        return False
    return True


def test_a_loop_stops_when_its_event_fires_with_the_stop() -> None:
    assert uvloop.run(stop_as_the_event_fires(wait_for))
    assert asyncio.run(stop_as_the_event_fires(wait_for))


def test_asyncio_wait_for_loses_that_stop_on_this_python_so_no_role_uses_it() -> None:
    # What the test above guards against: asyncio.wait_for (Python 3.11) drops the cancel.
    lost = not uvloop.run(stop_as_the_event_fires(asyncio.wait_for))
    users = [
        str(path.relative_to(REPO))
        for part in ("agentjet", "node", "coordinator", "sandboxes")
        for path in (REPO / part).rglob("*.py")
        if "asyncio.wait_for(" in path.read_text()
    ]
    assert users == [] or not lost, f"these use asyncio.wait_for: {users}"


def test_wait_for_returns_the_result_or_raises_timeout() -> None:
    async def scenario() -> None:
        assert await wait_for(asyncio.sleep(0, "done"), 1) == "done"
        with pytest.raises(TimeoutError):
            await wait_for(asyncio.Event().wait(), 0.01)

    uvloop.run(scenario())
