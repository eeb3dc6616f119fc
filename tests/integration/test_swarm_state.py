"""Two in-process hivemind peers (`SwarmOptimizer`s on their own DHTs, loopback): how a
trainer behind the swarm takes the state of one that keeps stepping.

CI once livelocked here after a cut link healed: the trainer ahead held its step lock
through a failed round and then loaded state from the one behind, which was itself
waiting for the first one's state; both timed out, every step, for minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time

import msgspec
import pytest
import torch

from agentjet.config import SwarmConfig
from node.dht import visible_maddrs
from node.rounds import StepOutcome
from node.swarm import SwarmOptimizer, attach_when_peered

pytestmark = pytest.mark.integration


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _fake_gradients(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 0.1


@pytest.mark.timeout(180)
def test_a_lone_trainer_starts_its_averagers_for_a_joiner_and_serves_it() -> None:
    """`attach_at_start=False`: alone, a trainer steps without hivemind's averager
    processes; a joiner's declared state averager is what its loop (`attach_when_peered`)
    sees, and the joiner, asking again, takes its state bit for bit."""
    run = SwarmConfig(
        run_id=f"test-attach-{time.monotonic_ns()}", averaging_timeout_s=5.0,
        request_timeout_s=0.5, heartbeat_s=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    model_a, model_b = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    a = SwarmOptimizer(
        run, model_a.parameters(), lr=1e-2, weight_decay=0.0, target_batch_size=1,
        attach_at_start=False,
    )  # fmt: skip
    b: SwarmOptimizer | None = None

    async def watch() -> None:  # the trainer's loop, until cancelled
        with contextlib.suppress(asyncio.CancelledError):
            await attach_when_peered(a, run.heartbeat_s)

    loop = asyncio.new_event_loop()
    watching = loop.create_task(watch())
    watcher = threading.Thread(target=loop.run_until_complete, args=(watching,))
    try:
        averagers = (a.optimizer.grad_averager, a.optimizer.state_averager)
        for seed in (1, 2):  # alone in the swarm: two versions
            _fake_gradients(model_a, seed)
            assert a.step_outcome(batch_size=1).applied
        assert a.epoch == 2 and not a.attached and not a.peered()
        assert not any(averager.is_alive() for averager in averagers)
        ahead = _weights(model_a)
        watcher.start()

        joined = msgspec.structs.replace(run, initial_peers=visible_maddrs(a.dht))
        b = SwarmOptimizer(
            joined, model_b.parameters(), lr=1e-2, weight_decay=0.0, target_batch_size=1,
            attach_at_start=False,
        )  # fmt: skip
        assert b.load_state_from_peers(wait_s=60.0, while_true=lambda: True)

        assert a.attached and all(averager.is_alive() for averager in averagers)
        assert b.epoch == 2
        for got, want in zip(_weights(model_b), ahead, strict=True):
            assert torch.equal(got, want)
    finally:
        if watcher.is_alive():
            loop.call_soon_threadsafe(watching.cancel)
            watcher.join(30)
        loop.close()
        a.shutdown()
        if b is not None:
            b.shutdown()


@pytest.mark.timeout(180)
def test_a_trainer_behind_takes_the_state_of_one_that_keeps_stepping() -> None:
    run = SwarmConfig(
        run_id=f"test-state-{time.monotonic_ns()}", averaging_timeout_s=5.0, request_timeout_s=0.5
    )
    torch.manual_seed(0)
    model_a, model_b = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    others_of_a = [0]
    a = SwarmOptimizer(
        run, model_a.parameters(), lr=1e-2, weight_decay=0.0, target_batch_size=1,
        other_trainers=lambda: others_of_a[0],
    )  # fmt: skip
    # Parameter rounds average copies, never the optimizer's own parameters in place: a
    # broken round's parts must not reach a version (node/averagers.py WholeStateAverager).
    assert not a.optimizer.offload_optimizer and not a.optimizer.state_averager.reuse_tensors
    b: SwarmOptimizer | None = None
    stop, stepping = threading.Event(), threading.Event()
    outcomes: list[StepOutcome] = []

    def keep_stepping() -> None:
        seed = 100
        while not stop.is_set():
            _fake_gradients(model_a, seed)
            outcomes.append(a.step_outcome(batch_size=1))
            stepping.set()
            seed += 1

    thread = threading.Thread(target=keep_stepping, name="trainer-a")
    try:
        for seed in (1, 2):  # alone in the swarm: two versions
            _fake_gradients(model_a, seed)
            assert a.step_outcome(batch_size=1).applied
        assert a.epoch == 2
        ahead = _weights(model_a)

        joined = msgspec.structs.replace(run, initial_peers=visible_maddrs(a.dht))
        b = SwarmOptimizer(
            joined, model_b.parameters(), lr=1e-2, weight_decay=0.0, target_batch_size=1,
            other_trainers=lambda: 1,
        )  # fmt: skip
        # From now on A's directory lists B, which does not step: every round of A fails.
        others_of_a[0] = 1
        thread.start()
        assert stepping.wait(60), "trainer A made no step"

        b.load_state_from_peers()

        assert b.epoch == 2, "B did not get A's state while A kept stepping"
        for got, want in zip(_weights(model_b), ahead, strict=True):
            assert torch.equal(got, want)
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(60)
        a.shutdown()
        if b is not None:
            b.shutdown()
    # A's failed rounds dropped their gradients and changed nothing: no step alone.
    assert outcomes and all(o.discarded and not o.applied and o.epoch == 2 for o in outcomes)
    for got, want in zip(_weights(model_a), ahead, strict=True):
        assert torch.equal(got, want)


@pytest.mark.timeout(180)
def test_a_withheld_version_passes_to_a_peer_as_withheld() -> None:
    """A version is withheld when a parameter round failed and no peer sent the version's
    state: its weights are the trainer's own (`StepOutcome.withheld`, which sets `own`).
    A peer with nobody better to download from takes them, and withholds them too:
    unmarked they would pass for the swarm's version; refused, a swarm whose trainers
    were all withheld had nobody to download from (CI: stuck for minutes). A step that
    applies makes the version the swarm's again, and so does downloading it."""
    run = SwarmConfig(
        run_id=f"test-own-{time.monotonic_ns()}", averaging_timeout_s=5.0, request_timeout_s=0.5
    )
    torch.manual_seed(0)
    model_a, model_b = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    a = SwarmOptimizer(
        run, model_a.parameters(), lr=1e-2, weight_decay=0.0, target_batch_size=1,
        other_trainers=lambda: 0,
    )  # fmt: skip
    b: SwarmOptimizer | None = None
    try:
        _fake_gradients(model_a, 1)
        assert a.step_outcome(batch_size=1).applied and not a.withheld
        assert a.optimizer.state_averager.state_sharing_priority == 1
        a.optimizer.hold_own(True)  # what a withheld step leaves
        # ranked below any peer that holds version 1 as the swarm's
        assert a.optimizer.state_averager.state_sharing_priority == 0.5
        joined = msgspec.structs.replace(run, initial_peers=visible_maddrs(a.dht))
        b = SwarmOptimizer(
            joined, model_b.parameters(), lr=1e-2, weight_decay=0.0, target_batch_size=1,
            other_trainers=lambda: 1,
        )  # fmt: skip
        assert not b.withheld
        assert b.load_state_from_peers()
        assert b.epoch == 1 and b.withheld
        assert b.optimizer.state_averager.state_sharing_priority == 0.5
        assert all(
            torch.equal(x, y) for x, y in zip(_weights(model_b), _weights(model_a), strict=True)
        )

        _fake_gradients(model_a, 2)  # a step that applies (alone, A is the swarm) clears it
        outcome = a.step_outcome(batch_size=1)
        assert outcome.applied and not outcome.withheld and not a.withheld
        assert a.optimizer.state_averager.state_sharing_priority == 2
        assert b.load_state_from_peers()
        assert b.epoch == a.epoch == 2 and not b.withheld
        assert b.optimizer.state_averager.state_sharing_priority == 2
        assert all(
            torch.equal(x, y) for x, y in zip(_weights(model_b), _weights(model_a), strict=True)
        )
    finally:
        a.shutdown()
        if b is not None:
            b.shutdown()


class _Leaky:
    """hivemind 1.1.12's fetcher pattern at shutdown: a read started, never finished nor
    cancelled, when the fetcher returns (`_fetch_progress_unless_shutdown_triggered`)."""

    async def _progress_fetcher(self) -> None:
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.ensure_future(asyncio.wait_for(never, None))
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown_triggered.wait)  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
def test_a_stopped_tracker_leaves_no_task_pending(caplog: pytest.LogCaptureFixture) -> None:
    """A trainer that stopped while its progress tracker was reading the DHT logged
    asyncio's "Task was destroyed but it is pending!" (test_durable, in CI). `Tracker`
    cancels what is left on its loop; hivemind's own tracker, the control, does not."""
    from hivemind.optim.progress_tracker import ProgressTracker

    from node.averagers import Tracker
    from node.dht import start_dht

    run = SwarmConfig(run_id=f"test-tracker-{time.monotonic_ns()}")
    dht = start_dht(run, keys=None)
    try:
        destroyed = {}
        for name, base in (("hivemind", ProgressTracker), ("ours", Tracker)):
            tracker = type("Tracker", (_Leaky, base), {})(
                dht, prefix=f"{run.run_id}-{name}", target_batch_size=1, start=True
            )
            tracker.shutdown(timeout=10)
            tracker.join(timeout=10)
            assert not tracker.is_alive()
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="asyncio"):
                del tracker
                gc.collect()
            destroyed[name] = "Task was destroyed but it is pending" in caplog.text
        assert destroyed == {"hivemind": True, "ours": False}
    finally:
        dht.shutdown()
