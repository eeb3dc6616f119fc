"""The one bridge from a role's event loop to blocking work.

    event loop (uvloop) ── await blocking(fn, *args) ──▶ a thread "agentjet-bridge_N" runs fn
         ▲   keeps serving (sockets, HTTP, timers)             │ torch compute, sandbox and
         └──────────────── fn's result or exception ◀──────────┘ docker calls, DHT requests

Every role runs asyncio on uvloop; work that blocks (a decode step of the engine, a program
in a sandbox, a docker request, a hivemind DHT call) crosses to a thread here, so "which
thread runs this" has one answer: the loop, or this bridge. (What runs behind the bridge
may keep threads of its own: the sandbox pool's recycler, hivemind's DHT client.)

The threads are a process-wide `ThreadPoolExecutor` of this module's own, rather than the
loop's default executor that `asyncio.to_thread` uses, for two reasons:

- Its bound is ours (`BRIDGE_THREADS`), not the default's `min(32, cpus + 4)`, which sizes
  for CPU work: most bridge calls wait (a sandboxed program, a docker or DHT request), and
  some wait on another bridge call (a sandbox acquire until an episode gives one back), so
  a bound near the core count would starve the calls that end the waits.
- Its threads carry one name (`THREAD_PREFIX`), so a thread dump, or a test counting
  threads, tells bridge work from anything else.

The executor is made on first use and outlives event loops (`agentjet eval` and tests run
one after another); its threads are started lazily and reused. A process forked after it
was used (hivemind's averagers) starts a fresh one: fork copies no threads. A role waits
for the calls still in flight (`finish`) after its loop ends and before its cleanup, as
asyncio's runner waits for its default executor.
`Exclusive` serialises the work of one resource (an engine: one decode or weight load at
a time) on whichever loop is running.

A user's code that may never return (a reward function) crosses by `detached` instead: a
daemon thread of its own, also named as the bridge's, that neither `finish` nor the
interpreter's exit waits for, so one that hangs holds no pool thread and no role's stop.
A thread cannot be stopped: one whose caller gave up on it (a timeout) runs on, counted by
`abandoned`, until its function returns, if ever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import itertools
import os
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# Threads the bridge runs at most: far above what a node runs at once (one engine call, a
# turn's tool calls, the sandbox acquires of its live episodes, a DHT request), since a
# call waiting on another must never keep that one from a thread. Made only when needed.
BRIDGE_THREADS = 256
# The name of every bridge thread ("agentjet-bridge_0", ...).
THREAD_PREFIX = "agentjet-bridge"
# The name of each thread `detached` starts ("agentjet-bridge_detached_0", ...).
DETACHED_PREFIX = THREAD_PREFIX + "_detached"

_executor: ThreadPoolExecutor | None = None
_in_flight: set[concurrent.futures.Future[Any]] = set()
_abandoned: set[threading.Thread] = set()  # detached threads running on, their await gone
_made = threading.Lock()  # guards the three
_detached_numbers = itertools.count()


async def blocking(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` in a bridge thread; the loop serves others meanwhile.

    Like `asyncio.to_thread`: the caller's context variables go along; cancelling the await
    skips `fn` if it has not started, and otherwise abandons its result (a thread cannot be
    stopped: `fn` runs to its end).
    """
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    future = _pool().submit(call)
    with _made:
        _in_flight.add(future)
    future.add_done_callback(_forget)
    return await asyncio.wrap_future(future)


async def detached(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`blocking` for a user's code that may never return: `fn(*args, **kwargs)` in a daemon
    thread of its own, started at once, which `finish` and the interpreter's exit do not
    wait for. Cancelling the await (a timeout around it) gives up on the result only: `fn`
    runs on, counted by `abandoned` until it returns.
    """
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()  # (so a cancelled await cannot cancel it)
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as e:  # noqa: BLE001 - the awaiting caller gets it
            future.set_exception(e)
        with _made:
            _abandoned.discard(thread)

    name = f"{DETACHED_PREFIX}_{next(_detached_numbers)}"
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        with _made:
            if not future.done():
                _abandoned.add(thread)
        raise


def abandoned() -> int:
    """`detached` calls still running whose callers gave up on them."""
    with _made:
        return len(_abandoned)


def finish() -> None:
    """Wait until every `blocking` call in flight has ended (`detached` ones are not waited
    for: they may never end). A role calls it once its loop is done and
    before its cleanup releases what those calls may use (the DHT, sandboxes, the engine):
    a call abandoned by a cancelled task still runs, and would otherwise wait forever on a
    DHT stopped under it, holding the interpreter's exit (which joins its threads)."""
    with _made:
        running = list(_in_flight)
    concurrent.futures.wait(running)


def is_bridge_thread(thread: threading.Thread | None = None) -> bool:
    """Whether `thread` (default: the current one) is one of the bridge's."""
    thread = thread or threading.current_thread()
    return thread.name.startswith(THREAD_PREFIX + "_")


class Exclusive:
    """One holder at a time, as an `asyncio.Lock` on whichever loop is running.

    A plain `asyncio.Lock` binds to the first loop it waits on; a resource made outside any
    loop and used by several in turn (tests and benches: one `asyncio.run` per call) needs
    a lock per loop. It is never used by two loops at once.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._lock = loop, asyncio.Lock()
        async with self._lock:
            yield


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _made:
        if _executor is None:
            _executor = ThreadPoolExecutor(BRIDGE_THREADS, thread_name_prefix=THREAD_PREFIX)
        return _executor


def _forget(future: concurrent.futures.Future[Any]) -> None:
    with _made:
        _in_flight.discard(future)


def _forget_in_child() -> None:
    """A forked child has none of the parent's threads: the copied executor would queue
    work that no thread takes, and the parent's calls are not the child's."""
    global _executor, _made
    _executor = None
    _in_flight.clear()
    _abandoned.clear()
    _made = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
