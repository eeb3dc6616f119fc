"""A second trainer's `SwarmOptimizer` in a process of its own, driven over a pipe, for
tests of two trainers' rounds.

Two optimizers in one process share hivemind's process-wide signing key, so their progress
records overwrite each other in the DHT and neither sees the other's batch: a peer must be
a process of its own, as every real trainer is. `Peer` starts it (spawned, so no thread
or lock of the test process is copied; it dies with the test process, tests/procs.py), asks
it to step or announce a batch, and reaps it by PID.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection
from typing import Any

import torch

from agentjet.config import SwarmConfig
from tests import procs

# Any answer from the peer comes within this long (a step waits for its round).
REPLY_TIMEOUT_S = 120.0


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """The model both trainers of a test hold (the same weights from the same seed)."""
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 32)


def fake_gradients(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 0.1


def _serve(conn: Connection, config: SwarmConfig, test_pid: int) -> None:
    from agentjet.lifeline import Lifeline
    from node.swarm import SwarmOptimizer

    procs.die_with_parent(test_pid)  # spawned: the test process's fork hook never ran here

    # hivemind forks its DHT and averagers, as in a trainer (a spawned process would
    # spawn them too, and they cannot be pickled).
    multiprocessing.set_start_method("fork", force=True)
    Lifeline.start("swarm-peer")  # its hivemind processes end with it, however it ends
    model = tiny_model()
    swarm = SwarmOptimizer(
        config, model.parameters(), lr=1e-2, weight_decay=0.0, target_batch_size=1,
        other_trainers=lambda: 1,
    )  # fmt: skip
    try:
        conn.send("ready")
        while True:
            command, arg = conn.recv()
            if command == "step":
                fake_gradients(model, arg)
                outcome = swarm.step_outcome(batch_size=1)
                conn.send((outcome.applied, outcome.epoch))
            elif command == "announce":
                swarm.rendezvous.announce(batch_size=1)
                conn.send(True)
            elif command == "weights":
                conn.send([p.detach().clone() for p in model.parameters()])
            else:
                return
    finally:
        swarm.shutdown()


class Peer:
    """The other trainer, in a spawned process; every call waits for its answer."""

    def __init__(self, config: SwarmConfig) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        # Not a daemon: those may not start processes (hivemind's DHT and averagers).
        self.process = context.Process(target=_serve, args=(child, config, os.getpid()))
        self.process.start()
        self._ask(None)  # its "ready"

    def _ask(self, message: Any) -> Any:
        if message is not None:
            self._conn.send(message)
        if not self._conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"the peer process said nothing for {REPLY_TIMEOUT_S:.0f} s")
        return self._conn.recv()

    def step(self, seed: int) -> tuple[bool, int]:
        """(applied, epoch) of a step on gradients made from `seed`."""
        return self._ask(("step", seed))  # type: ignore[no-any-return]

    def announce(self) -> None:
        """Say in the DHT that it holds a batch, and go into no round."""
        self._ask(("announce", None))

    def weights(self) -> list[torch.Tensor]:
        return self._ask(("weights", None))  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.process.is_alive():
            self._conn.send(("quit", None))
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()  # its lifeline ends what it started
            self.process.join()
