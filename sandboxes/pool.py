"""SandboxPool: a node's warm sandboxes, lent to one episode at a time.

    env ── pool.lease() ──▶ Lease.start() ── acquire (waits up to acquire_timeout_s) ──┐
                            Lease.exec / put_file / get_file ──▶ the lent sandbox   ◀──┘
                            Lease.close() ──▶ recycler: reset + health check ──▶ idle
                                                         └─ broken: close, make a new one

`size` sandboxes exist at most, so at most `size` episodes hold one at once: the pool
is the node's cap on sandbox concurrency. An episode that finds none free waits rather
than failing; only after `acquire_timeout_s` does it get a SandboxError (an episode
fault, "no_sandbox"). A sandbox comes back reset (work dir emptied, leftover processes
killed) and health-checked; one that fails either, or that died while idle (a container
killed from outside), is replaced by a new one from the factory.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agentjet.config import SandboxConfig
from sandboxes.base import ExecResult, Language, Sandbox, SandboxError
from sandboxes.process import ProcessSandbox

log = logging.getLogger(__name__)

# Sandboxes reset at once after their episodes end (each reset is one short exec).
RECYCLE_WORKERS = 4


@dataclass
class PoolStats:
    """Counters since the pool started (the rollout node writes them to its metrics)."""

    size: int = 0
    idle: int = 0
    in_use: int = 0
    acquired: int = 0
    waited: int = 0  # acquisitions that found no sandbox free
    wait_s: float = 0.0  # total time spent waiting
    timeouts: int = 0  # acquisitions that gave up
    replaced: int = 0  # broken sandboxes closed and made anew


class SandboxPool:
    """Up to `size` started sandboxes from `factory`; see the module docstring."""

    def __init__(
        self,
        factory: Callable[[], Sandbox],
        size: int,
        *,
        acquire_timeout_s: float = 120.0,
        name: str = "sandbox",
        on_close: Callable[[], object] | None = None,
    ) -> None:
        """`on_close` runs last in `close()` (the docker backend's sweep of its containers)."""
        if size < 1:
            raise ValueError(f"a sandbox pool needs size >= 1, got {size}")
        self.factory = factory
        self.size = size
        self.acquire_timeout_s = acquire_timeout_s
        self.name = name
        self.on_close = on_close
        self._idle: deque[Sandbox] = deque()
        self._empty_slots = size  # slots with no sandbox made yet (or a failed replacement)
        self._lent: set[int] = set()  # id() of lent sandboxes
        self._closed = False
        self._cond = threading.Condition()
        self._stats = PoolStats(size=size)
        self._recycler = ThreadPoolExecutor(RECYCLE_WORKERS, thread_name_prefix=f"{name}-recycle")

    def start(self) -> None:
        """Make and start every sandbox now (in parallel), so the first episodes don't wait.

        SandboxError, with everything made so far closed, when one cannot be made."""
        with self._cond:
            missing, self._empty_slots = self._empty_slots, 0
        with ThreadPoolExecutor(min(missing, 8) or 1) as workers:
            results = list(workers.map(lambda _: _try_make(self.factory), range(missing)))
        made = [box for box in results if isinstance(box, Sandbox)]
        errors = [e for e in results if isinstance(e, SandboxError)]
        with self._cond:
            self._idle.extend(made)
            self._cond.notify_all()
        if errors:
            self.close()
            raise SandboxError(f"{self.name} pool: {errors[0]}")
        log.info("%s pool: %d sandboxes warm", self.name, len(made))

    def acquire(self, timeout_s: float | None = None) -> Sandbox:
        """A started, reset, healthy sandbox; waits up to `timeout_s` for one to be free."""
        timeout_s = self.acquire_timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        deadline = started + timeout_s
        with self._cond:
            waited = False
            while not self._idle and self._empty_slots == 0:
                if self._closed:
                    raise SandboxError(f"{self.name} pool is closed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._stats.timeouts += 1
                    raise SandboxError(
                        f"no sandbox free within {timeout_s:g} s (all {self.size} in use)"
                    )
                waited = True
                self._cond.wait(remaining)
            if self._closed:
                raise SandboxError(f"{self.name} pool is closed")
            box = self._idle.popleft() if self._idle else None
            if box is None:
                self._empty_slots -= 1
            self._stats.acquired += 1
            if waited:
                self._stats.waited += 1
                self._stats.wait_s += time.monotonic() - started
        if box is not None and not box.healthy():  # died while idle
            self._discard(box)
            box = None
        if box is None:
            try:
                box = self.factory()
                box.start()
            except SandboxError:
                with self._cond:
                    self._empty_slots += 1
                    self._cond.notify()
                raise
        with self._cond:
            self._lent.add(id(box))
        return box

    def release(self, box: Sandbox) -> None:
        """Give back a sandbox from `acquire`; it is reset (or replaced) in the background."""
        with self._cond:
            if id(box) not in self._lent:
                raise SandboxError("release() of a sandbox this pool did not lend")
            self._lent.discard(id(box))
            closed = self._closed
        if closed:
            _close_quietly(box)
            return
        try:
            self._recycler.submit(self._recycle, box)
        except RuntimeError:  # the pool closed meanwhile
            _close_quietly(box)

    def lease(self) -> Sandbox:
        """An unstarted handle: start() acquires a sandbox, close() gives it back. For
        environments that make one sandbox per episode with a factory."""
        return Lease(self)

    def stats(self) -> PoolStats:
        with self._cond:
            self._stats.idle = len(self._idle)
            self._stats.in_use = len(self._lent)
            return PoolStats(**vars(self._stats))

    def close(self) -> None:
        """Close the idle sandboxes now, lent ones when they come back. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle = list(self._idle)
            self._idle.clear()
            self._cond.notify_all()
        self._recycler.shutdown(wait=True)
        for box in idle:
            _close_quietly(box)
        if self.on_close is not None:
            with contextlib.suppress(SandboxError):
                self.on_close()

    def _recycle(self, box: Sandbox) -> None:
        try:
            box.reset()
            healthy = box.healthy()
        except SandboxError as e:
            log.warning("%s pool: reset failed (%s); replacing the sandbox", self.name, e)
            healthy = False
        if not healthy:
            self._discard(box)
            result = _try_make(self.factory)
            if isinstance(result, SandboxError):
                log.warning("%s pool: cannot replace a sandbox: %s", self.name, result)
                with self._cond:
                    self._empty_slots += 1  # the next acquire tries again
                    self._cond.notify()
                return
            box = result
        with self._cond:
            if self._closed:
                closed_box: Sandbox | None = box
            else:
                closed_box = None
                self._idle.append(box)
                self._cond.notify()
        if closed_box is not None:
            _close_quietly(closed_box)

    def _discard(self, box: Sandbox) -> None:
        _close_quietly(box)
        with self._cond:
            self._stats.replaced += 1


class Lease(Sandbox):
    """A pool's sandbox behind the `Sandbox` interface, for the span of start()..close()."""

    def __init__(self, pool: SandboxPool) -> None:
        self.pool = pool
        self.box: Sandbox | None = None

    def start(self) -> None:
        if self.box is None:
            self.box = self.pool.acquire()

    def close(self) -> None:
        box, self.box = self.box, None
        if box is not None:
            self.pool.release(box)

    def exec(self, code: str, timeout_s: float, *, language: Language = "python") -> ExecResult:
        return self._box().exec(code, timeout_s, language=language)

    def put_file(self, path: str, data: bytes) -> None:
        self._box().put_file(path, data)

    def get_file(self, path: str) -> bytes:
        return self._box().get_file(path)

    def reset(self) -> None:
        self._box().reset()

    def healthy(self) -> bool:
        return self.box is not None and self.box.healthy()

    def _box(self) -> Sandbox:
        if self.box is None:
            raise SandboxError("the sandbox is not started: call start() first")
        return self.box


def _try_make(factory: Callable[[], Sandbox]) -> Sandbox | SandboxError:
    box = factory()
    try:
        box.start()
    except SandboxError as e:
        return e
    return box


def _close_quietly(box: Sandbox) -> None:
    with contextlib.suppress(SandboxError):
        box.close()


def open_pool(config: SandboxConfig, node_id: str) -> SandboxPool:
    """A node's started pool for the configured backend. For docker, containers that
    crashed nodes of this host left behind are removed first, and the pool's close
    removes every container this process made."""
    factory: Callable[[], Sandbox]
    on_close: Callable[[], object] | None = None
    if config.backend == "docker":
        from sandboxes.docker_sandbox import DockerEngine, DockerSandbox, DockerSettings

        engine = DockerEngine(node_id)
        engine.reap_orphans()
        settings = DockerSettings(
            image=config.image,
            memory_bytes=config.memory_mb << 20,
            cpus=config.cpus,
            pids=config.pids,
            work_dir_bytes=config.work_dir_mb << 20,
            network=config.network,
        )
        factory = functools.partial(DockerSandbox, engine, settings)
        on_close = engine.remove_ours
    else:
        factory = ProcessSandbox
    pool = SandboxPool(
        factory,
        config.pool_size,
        acquire_timeout_s=config.acquire_timeout_s,
        name=config.backend,
        on_close=on_close,
    )
    pool.start()
    return pool
