"""What both inference engines share (node/engine_base.py): their blocking work runs in a
bridge thread, one call at a time, and a new policy version tags the calls after it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from agentjet.bridge import is_bridge_thread
from agentjet.errors import EngineError
from node.engine_base import BridgedEngine

pytestmark = pytest.mark.unit

# How long each blocking call holds its thread: long enough for overlapping calls to show.
HOLD_S = 0.02


class CountingEngine(BridgedEngine):
    """An engine whose blocking work records where it ran and how many ran at once."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[threading.Thread] = []
        self.running = 0
        self.most_running = 0
        self.versions_seen: list[int] = []
        self._count = threading.Lock()

    def work(self, name: str) -> str:
        with self._count:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.threads.append(threading.current_thread())
            self.versions_seen.append(self.policy_version)
        time.sleep(HOLD_S)
        with self._count:
            self.running -= 1
        return name


def test_calls_run_in_bridge_threads_one_at_a_time() -> None:
    engine = CountingEngine()

    async def main() -> list[str]:
        return await asyncio.gather(*(engine._exclusive(engine.work, f"c{i}") for i in range(4)))

    assert asyncio.run(main()) == ["c0", "c1", "c2", "c3"]
    assert engine.most_running == 1
    assert len(engine.threads) == 4 and all(is_bridge_thread(t) for t in engine.threads)


def test_a_new_version_tags_every_call_queued_behind_its_load() -> None:
    engine = CountingEngine()

    async def main() -> None:
        first = asyncio.create_task(engine._exclusive(engine.work, "decode before"))
        await asyncio.sleep(0)  # its turn taken
        load = asyncio.create_task(engine._load_version(3, engine.work, "load"))
        after = asyncio.create_task(engine._exclusive(engine.work, "decode after"))
        await asyncio.gather(first, load, after)

    assert engine.policy_version == 0
    asyncio.run(main())
    assert engine.policy_version == 3
    assert engine.versions_seen == [0, 0, 3]


def test_what_a_caller_does_right_after_its_turn_comes_before_the_next_call() -> None:
    """(The vLLM engine records a policy's adapter version so.)"""
    engine = CountingEngine()
    done: list[str] = []

    async def load() -> None:
        await engine._exclusive(engine.work, "load")
        done.append("recorded")

    async def decode() -> None:
        await engine._exclusive(lambda: done.append("decode"))

    async def main() -> None:
        await asyncio.gather(load(), decode())

    asyncio.run(main())
    assert done == ["recorded", "decode"]


def test_a_failed_call_lets_the_next_one_run() -> None:
    engine = CountingEngine()

    def fail() -> None:
        raise ValueError("bad weights")

    async def main() -> str:
        with pytest.raises(ValueError, match="bad weights"):
            await engine._load_version(5, fail)
        return await engine._exclusive(engine.work, "next")

    assert asyncio.run(main()) == "next"
    assert engine.policy_version == 0


def test_an_engine_that_failed_stays_failed_and_says_so_to_every_later_call() -> None:
    """An EngineError (vLLM's engine core died) ends the engine: it is kept as `failure`
    and every later call, a decode or a weight load, raises it without running."""
    engine = CountingEngine()

    def core_died() -> None:
        raise EngineError("vLLM's engine core died")

    async def main() -> None:
        with pytest.raises(EngineError):
            await engine._exclusive(core_died)
        for later in (
            engine._exclusive(engine.work, "a"),
            engine._load_version(3, engine.work, "b"),
        ):
            with pytest.raises(EngineError, match="engine core died"):
                await later

    asyncio.run(main())
    assert isinstance(engine.failure, EngineError)
    assert engine.threads == [] and engine.policy_version == 0
