"""Running a role process: logging, uvloop, signals, and the setup → run → cleanup lifecycle.

Every role (coordinator, trainer, rollout) is a class with `setup(cleanup)` (wire
components, pushing each one's release onto `cleanup` as it is made) and `async run(stop)`
(drive them until `stop` is set or the work ends). SIGINT and SIGTERM set `stop` while
running and abort set-up before; either way the cleanup stack unwinds in reverse order,
so a stopped node leaves no socket, hivemind daemon or half-written file behind. Blocking
calls still running on the bridge (agentjet/bridge.py) end before it unwinds. A node
killed outright (SIGKILL, the OOM killer) has its lifeline watcher end every process it
started (agentjet/lifeline.py).

A node that seems stuck tells what it is doing: `kill -USR1 PID` writes every thread's
stack to its log (Python's faulthandler: works even when the event loop is blocked), and a
stop that has not finished within STOP_REPORT_S writes them, with the loop's tasks, itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import faulthandler
import logging
import signal
import sys
import threading
from collections.abc import Awaitable, Coroutine
from contextlib import ExitStack
from typing import Any, NoReturn, Protocol, TypeVar

import uvloop

from agentjet import bridge
from agentjet.lifeline import Lifeline

T = TypeVar("T")


class Role(Protocol):
    def setup(self, cleanup: ExitStack) -> None: ...

    async def run(self, stop: asyncio.Event) -> None: ...


# What part of a role a log line comes from, where one process runs several (a trainer
# serving several policies: its lines read `trainer[POLICY]`). Tasks and bridge calls
# inherit it from the code that started them.
log_context: contextvars.ContextVar[str] = contextvars.ContextVar("log_context", default="")


class _LogContext(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        context = log_context.get()
        record.context = f"[{context}]" if context else ""
        return True


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name}%(context)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_LogContext())


# A stop still under way after this long writes what it waits on to the log (once).
STOP_REPORT_S = 20.0


def _report_stuck(name: str, loop: asyncio.AbstractEventLoop) -> None:
    """Write every thread's stack, and (when the loop still runs) its tasks', to stderr."""
    logging.getLogger(name).warning(
        "stopping has taken over %.0f s; what each thread and task is doing:", STOP_REPORT_S
    )
    faulthandler.dump_traceback(all_threads=True)

    def tasks() -> None:
        for task in asyncio.all_tasks(loop):
            task.print_stack(limit=12, file=sys.stderr)

    with contextlib.suppress(RuntimeError):  # the loop has ended: only threads are left
        loop.call_soon_threadsafe(tasks)


def _abort_setup(signum: int, frame: Any) -> NoReturn:
    raise SystemExit(128 + signum)


def run_role(role: Role, name: str) -> int:
    """Run `role` to completion on uvloop; returns the process exit code."""
    setup_logging(name)
    log = logging.getLogger(name)

    reporter: threading.Timer | None = None

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def stopping() -> None:
            nonlocal reporter
            stop.set()
            if reporter is None:
                reporter = threading.Timer(STOP_REPORT_S, _report_stuck, (name, loop))
                reporter.daemon = True
                reporter.start()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping)
        await role.run(stop)

    signal.signal(signal.SIGTERM, _abort_setup)
    signal.signal(signal.SIGINT, _abort_setup)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Before any other process is started: whatever kills this one, they end with it.
    lifeline = Lifeline.start(name)
    try:
        with ExitStack() as cleanup:
            role.setup(cleanup)
            try:
                uvloop.run(main())
            finally:
                bridge.finish()  # blocking calls end before what they use is released
    finally:
        if reporter is not None:
            reporter.cancel()
        if lifeline is not None:
            lifeline.close()  # cleanup ran: the watcher ends only stragglers, then exits
    log.info("%s stopped", name)
    return 0


def print_join_command(maddrs: list[str], keys_path: str) -> None:
    """The first node of a swarm prints the command other machines run to join it."""
    reachable = [m for m in maddrs if "/127.0.0.1/" not in m] or maddrs
    joins = " ".join(f"--join {m}" for m in reachable)
    access = f"--keys {keys_path}" if keys_path else "--set net.insecure=true"
    where = f" (copy {keys_path} to each machine first)" if keys_path else ""
    print(
        f"swarm started; add nodes with{where}:\n"
        f"  agentjet node --role trainer|rollout {access} {joins}",
        flush=True,
    )


async def supervise(stop: asyncio.Event, loops: dict[str, Coroutine[Any, Any, None]]) -> None:
    """Run a role's named background loops until `stop` is set or one of them ends.

    A loop that fails ends the run with its error; one that returns early (a bug: loops run
    forever) raises too. Every loop is cancelled and awaited before this returns.
    """
    tasks = [asyncio.create_task(coro, name=name) for name, coro in loops.items()]
    stopping = asyncio.create_task(stop.wait(), name="stop")
    try:
        done, _ = await asyncio.wait([*tasks, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in [*tasks, stopping]:
            task.cancel()
        await asyncio.gather(*tasks, stopping, return_exceptions=True)
    for task in done - {stopping}:
        task.result()  # re-raise the failure of a background loop
        if not stop.is_set():
            raise RuntimeError(f"{task.get_name()} stopped unexpectedly")


async def wait_for(awaitable: Awaitable[T], timeout_s: float) -> T:
    """`await awaitable`, or TimeoutError after `timeout_s`: what every role's loops use.

    Not `asyncio.wait_for`: on Python 3.11, when the awaited thing completes in the same
    loop iteration as the task is cancelled, it returns the result and drops the
    cancellation, so a `while True` loop that waits on an event never sees its stop, and
    `supervise` waits for it forever (a rollout node hung at stop so in CI: a trainer's
    reply set an event just as SIGTERM arrived). `asyncio.timeout` keeps the cancellation.
    """
    async with asyncio.timeout(timeout_s):
        return await awaitable
