"""SandboxPool with real process sandboxes: lending, waiting, timeouts, replacement."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from sandboxes.base import SandboxError
from sandboxes.pool import SandboxPool
from sandboxes.process import ProcessSandbox

pytestmark = pytest.mark.integration

QUICK_S = 10.0


class FlakySandbox(ProcessSandbox):
    """A process sandbox a test can declare broken, as a killed container would be."""

    made: list[FlakySandbox] = []

    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        FlakySandbox.made.append(self)

    def healthy(self) -> bool:
        return not self.broken


@pytest.fixture
def flaky() -> type[FlakySandbox]:
    FlakySandbox.made = []
    return FlakySandbox


def test_a_sandbox_comes_back_reset(flaky: type[FlakySandbox]) -> None:
    pool = SandboxPool(flaky, 1, acquire_timeout_s=QUICK_S)
    pool.start()
    try:
        box = pool.acquire()
        box.put_file("secret.txt", b"episode 1")
        pool.release(box)
        again = pool.acquire()
        assert again is box  # the same warm sandbox, not a new one
        assert again.exec("import os; print(os.listdir('.'))", QUICK_S).stdout == "[]\n"
        pool.release(again)
    finally:
        pool.close()
    assert len(flaky.made) == 1


def test_lending_never_exceeds_the_pool_size(flaky: type[FlakySandbox]) -> None:
    pool = SandboxPool(flaky, 2, acquire_timeout_s=QUICK_S)
    pool.start()
    lock = threading.Lock()
    holding = 0
    most = 0

    def episode(i: int) -> str:
        nonlocal holding, most
        lease = pool.lease()
        lease.start()
        with lock:
            holding += 1
            most = max(most, holding)
        try:
            return lease.exec(f"print({i} * 2)", QUICK_S).stdout
        finally:
            with lock:
                holding -= 1
            lease.close()

    try:
        with ThreadPoolExecutor(8) as threads:
            outputs = list(threads.map(episode, range(24)))
        stats = pool.stats()
    finally:
        pool.close()
    assert outputs == [f"{i * 2}\n" for i in range(24)]
    assert most == 2
    assert stats.acquired == 24 and stats.waited > 0 and stats.timeouts == 0
    assert len(flaky.made) == 2  # everything ran on the two warm sandboxes


def test_waiting_for_a_busy_pool_times_out_with_a_clear_error(flaky: type[FlakySandbox]) -> None:
    pool = SandboxPool(flaky, 1, acquire_timeout_s=0.2)
    pool.start()
    try:
        held = pool.acquire()
        with pytest.raises(SandboxError, match=r"no sandbox free within 0.2 s \(all 1 in use\)"):
            pool.acquire()
        assert pool.stats().timeouts == 1
        pool.release(held)
        pool.release(pool.acquire())  # free again once given back
    finally:
        pool.close()


def test_a_broken_sandbox_is_replaced_after_use_and_while_idle(
    flaky: type[FlakySandbox],
) -> None:
    pool = SandboxPool(flaky, 1, acquire_timeout_s=QUICK_S)
    pool.start()
    try:
        first = pool.acquire()
        first.broken = True  # died during its episode
        pool.release(first)
        second = pool.acquire()
        assert second is not first and second.healthy()
        pool.release(second)
        # Wait until the recycler has put it back, then let it die while idle.
        third = pool.acquire()
        assert third is second
        pool.release(third)
        idle = pool.acquire()
        pool.release(idle)
        flaky.made[-1].broken = True
        fourth = pool.acquire()
        assert fourth is not second and fourth.exec("print(1)", QUICK_S).ok
        pool.release(fourth)
        assert pool.stats().replaced == 2
    finally:
        pool.close()
    assert first._root is None  # the broken one was closed, not leaked


def test_a_factory_that_fails_gives_a_sandbox_error_and_keeps_the_slot() -> None:
    attempts = 0

    class Unmakeable(ProcessSandbox):
        def start(self) -> None:
            nonlocal attempts
            attempts += 1
            if attempts <= 2:
                raise SandboxError("engine down")
            super().start()

    pool = SandboxPool(Unmakeable, 1, acquire_timeout_s=QUICK_S)
    with pytest.raises(SandboxError, match="engine down"):
        pool.start()
    pool = SandboxPool(Unmakeable, 1, acquire_timeout_s=QUICK_S)
    with pytest.raises(SandboxError, match="engine down"):
        pool.acquire()  # made lazily: fails
    box = pool.acquire()  # the slot was kept: the next try makes one
    assert box.exec("print(3)", QUICK_S).stdout == "3\n"
    pool.release(box)
    pool.close()


def test_closing_the_pool_closes_idle_and_returning_sandboxes(flaky: type[FlakySandbox]) -> None:
    closed: list[str] = []
    pool = SandboxPool(flaky, 2, acquire_timeout_s=QUICK_S, on_close=lambda: closed.append("x"))
    pool.start()
    lent = pool.acquire()
    pool.close()
    pool.close()  # idempotent
    assert closed == ["x"]
    assert [box._root is None for box in flaky.made].count(True) == 1  # the idle one
    pool.release(lent)
    assert all(box._root is None for box in flaky.made)
    with pytest.raises(SandboxError, match="closed"):
        pool.acquire()
    with pytest.raises(SandboxError, match="did not lend"):
        pool.release(ProcessSandbox())
