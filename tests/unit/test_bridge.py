"""The bridge from the event loop to blocking work: where calls run, what a role waits for
at its end, a user's call that never returns, and one-at-a-time use of a resource from one
loop after another."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from agentjet.bridge import Exclusive, abandoned, blocking, detached, finish, is_bridge_thread

pytestmark = pytest.mark.unit

REQUEST = contextvars.ContextVar("REQUEST", default="none")


def test_a_call_runs_in_a_bridge_thread_with_the_callers_context() -> None:
    def where() -> tuple[threading.Thread, str]:
        return threading.current_thread(), REQUEST.get()

    async def main() -> tuple[threading.Thread, str]:
        REQUEST.set("episode 7")
        return await blocking(where)

    thread, seen = asyncio.run(main())
    assert is_bridge_thread(thread) and not is_bridge_thread()
    assert seen == "episode 7"


def test_finish_waits_for_a_call_its_caller_abandoned() -> None:
    """A cancelled task leaves its call running; a role's cleanup must not start under it."""
    gate, started, ended = threading.Event(), threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        gate.wait()
        ended.set()

    async def abandon() -> None:
        call = asyncio.ensure_future(blocking(slow))
        await asyncio.sleep(0)  # the task submits the call
        started.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(abandon())
    assert not ended.is_set()
    opener = threading.Thread(target=gate.set)
    opener.start()
    finish()
    assert ended.is_set()
    opener.join()


def test_a_detached_call_given_up_runs_on_counted_and_finish_does_not_wait_for_it() -> None:
    """A user's function that never returns: its caller gives up (a timeout cancels the
    await); its thread, a daemon bridge thread with the caller's context, cannot be stopped
    and is counted until the function returns. A role's stop (`finish`) does not wait."""
    entered, release = threading.Event(), threading.Event()
    seen: list[tuple[threading.Thread, str]] = []

    def hangs() -> None:
        seen.append((threading.current_thread(), REQUEST.get()))
        entered.set()
        release.wait()

    def raises() -> None:
        raise KeyError("no such column")

    async def give_up() -> None:
        REQUEST.set("reward check")
        with pytest.raises(KeyError):
            await detached(raises)  # what the function raises, the caller gets
        call = asyncio.ensure_future(detached(hangs))
        await blocking(entered.wait)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(give_up())
    [(thread, context)] = seen
    assert is_bridge_thread(thread) and thread.daemon and thread.is_alive()
    assert context == "reward check"
    assert abandoned() == 1
    finish()  # returns, the thread still blocked
    release.set()
    thread.join()
    assert abandoned() == 0


def test_exclusive_serves_one_loop_after_another() -> None:
    """Held with waiters on two loops in turn (a plain asyncio.Lock binds to the first)."""
    exclusive = Exclusive()

    async def two_holders() -> list[str]:
        order: list[str] = []

        async def hold(name: str) -> None:
            async with exclusive.hold():
                order.append(f"{name} in")
                await asyncio.sleep(0)
                order.append(f"{name} out")

        await asyncio.gather(hold("a"), hold("b"))
        return order

    for _ in range(2):
        assert asyncio.run(two_holders()) == ["a in", "a out", "b in", "b out"]
