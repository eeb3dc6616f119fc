"""Gradient rounds between two in-process hivemind peers (`SwarmOptimizer`s on their own
DHTs, loopback) whose batches do not come together, and a stop at the moments a trainer
waits on the swarm: for its peers' batches, in a round, in a state download.

On a busy box two trainers fed by one rollout node finish their batches seconds apart;
the first used to step at once, find nobody, and throw its batch away (issue 47: 2 rounds
of 24 formed in 20 minutes). A Ctrl-C while a trainer downloaded the swarm's state was
swallowed by hivemind's retry loop, and a stop mid-round waited out the round.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
import torch

from agentjet.config import SwarmConfig
from agentjet.roles import _abort_setup
from node.dht import visible_maddrs
from node.rounds import StepOutcome
from node.swarm import SwarmOptimizer
from tests.swarm_peer import Peer, fake_gradients, tiny_model

pytestmark = pytest.mark.integration

# A stop must end a wait on the swarm within this long (it polls every 0.25 s).
STOP_WITHIN_S = 5.0
THREAD_JOIN_S = 60.0


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@contextmanager
def _pair(averaging_timeout_s: float) -> Iterator[tuple[SwarmOptimizer, torch.nn.Module, Peer]]:
    """Trainer A (here) and trainer B (a process of its own, `Peer`) of one run, each
    seeing the other as a live trainer, both at version 0 with the same weights."""
    run = SwarmConfig(
        run_id=f"test-rounds-{time.monotonic_ns()}",
        averaging_timeout_s=averaging_timeout_s,
        request_timeout_s=0.5,
    )
    model = tiny_model()
    a = SwarmOptimizer(
        run, model.parameters(), lr=1e-2, weight_decay=0.0, target_batch_size=1,
        other_trainers=lambda: 1,
    )  # fmt: skip
    b: Peer | None = None
    try:
        b = Peer(msgspec.structs.replace(run, initial_peers=visible_maddrs(a.dht)))
        yield a, model, b
    finally:
        if b is not None:
            b.close()
        a.shutdown()


def _step_in_thread(swarm: SwarmOptimizer, out: list[StepOutcome]) -> threading.Thread:
    thread = threading.Thread(target=lambda: out.append(swarm.step_outcome(batch_size=1)))
    thread.start()
    return thread


@pytest.mark.timeout(240)
def test_two_trainers_meet_in_a_round_though_their_batches_come_seconds_apart() -> None:
    """A's batch is ready 6 s before B's, longer than a matchmaking window: A waits for
    B's (its progress record says it holds one) and both step together, same weights."""
    with _pair(averaging_timeout_s=30.0) as (a, model, b):
        first: list[StepOutcome] = []
        fake_gradients(model, 1)
        thread = _step_in_thread(a, first)
        time.sleep(6.0)  # B's batch comes later (the delay under test, not a synchronisation)
        applied, epoch = b.step(seed=2)
        thread.join(THREAD_JOIN_S)
        assert not thread.is_alive()
        assert first[0].applied and applied, (first, applied)
        assert a.epoch == epoch == 1
        for x, y in zip(_weights(model), b.weights(), strict=True):
            assert torch.equal(x, y)
        assert a.round_problem == ""
        # the round's time is measured: the next rounds' timeouts follow it
        measured = a.optimizer.round_timeout.round_s
        assert measured is not None and 0.0 < measured < 30.0
        # ... and the averager's process rounds with the timeout it is given: one too short
        # for any all-reduce fails the next round here, and nothing is applied
        a.optimizer.grad_averager.set_round_timeout(1e-4)
        second: list[StepOutcome] = []
        before = _weights(model)
        fake_gradients(model, 3)
        thread = _step_in_thread(a, second)
        b.step(seed=4)
        thread.join(THREAD_JOIN_S)
        assert not second[0].applied and a.epoch == 1, second
        for x, y in zip(_weights(model), before, strict=True):
            assert torch.equal(x, y)


@pytest.mark.timeout(240)
def test_a_stop_gives_up_a_step_waiting_for_its_peers_and_trains_nothing() -> None:
    """B never brings a batch: A waits (up to a minute here) until it stops, then gives
    the step up at once, its weights untouched and its gradients not applied."""
    with _pair(averaging_timeout_s=60.0) as (a, model, _):
        before = _weights(model)
        out: list[StepOutcome] = []
        fake_gradients(model, 1)
        thread = _step_in_thread(a, out)
        time.sleep(2.0)  # A is waiting by now (a delay, not a synchronisation)
        stopped = time.monotonic()
        a.stop()
        thread.join(THREAD_JOIN_S)
        assert time.monotonic() - stopped < STOP_WITHIN_S
        assert out[0].discarded and not out[0].applied and a.epoch == 0
        for got, want in zip(_weights(model), before, strict=True):
            assert torch.equal(got, want)


@pytest.mark.timeout(240)
def test_a_stop_gives_up_a_round_in_flight() -> None:
    """B says it holds a batch but never joins the round: A's round waits in matchmaking
    (up to a minute here) until A stops, then is given up, nothing applied."""
    with _pair(averaging_timeout_s=60.0) as (a, model, b):
        b.announce()  # B's progress record: a batch, but no round
        out: list[StepOutcome] = []
        fake_gradients(model, 1)
        thread = _step_in_thread(a, out)
        deadline = time.monotonic() + 60
        while a.optimizer.scheduled_grads is None and time.monotonic() < deadline:
            time.sleep(0.1)  # polls for A's round to begin
        assert a.optimizer.scheduled_grads is not None, "A's round never began"
        stopped = time.monotonic()
        a.stop()
        thread.join(THREAD_JOIN_S)
        assert time.monotonic() - stopped < STOP_WITHIN_S
        assert out[0].discarded and not out[0].applied and a.epoch == 0
        # A stop is not a failed round: nothing to warn about
        assert a.counts()["failed_rounds"] == 0


@pytest.mark.timeout(240)
def test_a_ctrl_c_while_downloading_the_swarms_state_stops_the_download() -> None:
    """B is busy (its step lock held: it serves its state between steps only), so A's
    download of its state waits. A Ctrl-C then (a role's SIGINT during set-up raises
    SystemExit) ends it at once: hivemind's own loop caught it and asked again, forever."""
    run = SwarmConfig(run_id=f"test-ctrl-c-{time.monotonic_ns()}", request_timeout_s=0.5)
    a = SwarmOptimizer(
        run, tiny_model().parameters(), lr=1e-2, weight_decay=0.0, target_batch_size=1
    )
    b: SwarmOptimizer | None = None
    previous = signal.signal(signal.SIGINT, _abort_setup)
    timer = threading.Timer(3.0, signal.raise_signal, (signal.SIGINT,))
    try:
        joined = msgspec.structs.replace(run, initial_peers=visible_maddrs(a.dht))
        b = SwarmOptimizer(
            joined, tiny_model().parameters(), lr=1e-2, weight_decay=0.0, target_batch_size=1
        )
        with b.optimizer.step_lock:
            timer.start()
            began = time.monotonic()
            with pytest.raises(SystemExit):
                a.load_state_from_peers(wait_s=120.0, while_true=lambda: True)
            assert time.monotonic() - began < 3.0 + STOP_WITHIN_S
            assert a.optimizer.loading.is_set() is False
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
        a.shutdown()
        if b is not None:
            b.shutdown()
