"""`Rendezvous`: before a gradient round, a trainer waits for the other live trainers'
batches, so that they step together (node/swarm.py `SwarmOptimizer.step_outcome` holds one).

    batch ready ──announce──▶ hivemind's progress record (DHT): "a batch for epoch E"
        ──meet: poll the others' records every PEER_POLL_S──▶ every other live trainer
        holds one, or `RoundPace.wait_s` passed (node/rounds.py) ──▶ the gradient round;
        the trainer stops meanwhile ──▶ the batch is given up (its groups are not trained)

Without it the first trainer with a batch stepped at once, found nobody and threw its
batch away, and so did the next (issue 47: 2 rounds of 24 in 20 minutes). The wait is
outside the step lock, so the trainer serves its state meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import hivemind

from node.optimizer import HivemindOptimizer
from node.rounds import RoundPace

log = logging.getLogger(__name__)

# A step waiting for the other trainers' batches reads their progress records this often.
PEER_POLL_S = 0.5


def batches_ready(entries: object, own_key: object, epoch: int) -> int:
    """How many of the progress records `entries` (hivemind's, by subkey, as read from the
    DHT) are another trainer's that holds a batch for `epoch`; anything malformed a
    stranger stored there is skipped."""
    if not isinstance(entries, dict):
        return 0
    ready = 0
    for subkey, entry in entries.items():
        progress = getattr(entry, "value", None)
        if subkey == own_key or not isinstance(progress, dict):
            continue
        samples = progress.get("samples_accumulated")
        ready += (
            progress.get("epoch") == epoch
            and isinstance(samples, int)
            and samples > 0
            and progress.get("client_mode") is False
        )
    return ready


class Rendezvous:
    """A trainer's wait for its peers' batches, through `optimizer`'s progress records in
    `dht`; `other_trainers()`: how many other live trainers the directory lists now."""

    def __init__(
        self,
        optimizer: HivemindOptimizer,
        dht: hivemind.DHT,
        other_trainers: Callable[[], int],
        floor_s: float,
    ) -> None:
        """`floor_s`: the least a wait lasts (`swarm.averaging_timeout_s`)."""
        self.optimizer = optimizer
        self.dht = dht
        self.other_trainers = other_trainers
        # How long a step waits for the other trainers' batches, sized from its cycles.
        self.pace = RoundPace(floor_s=floor_s)
        self.waits = 0  # steps whose peers' batches did not come within the wait

    def announce(self, batch_size: int) -> None:
        """Tell the swarm (hivemind's progress records) that this trainer holds a batch
        of `batch_size` more samples for its epoch, before it waits for the others'."""
        optimizer = self.optimizer
        with optimizer.step_lock:
            held = optimizer.grad_averager.local_samples_accumulated + batch_size
            optimizer.tracker.report_local_progress(optimizer.local_epoch, held)
            optimizer._publish_progress()

    def ready(self) -> int:
        """How many other trainers' progress records say they hold a batch for this
        trainer's epoch (a DHT read)."""
        tracker = self.optimizer.tracker
        found = self.dht.get(tracker.training_progress_key, latest=True)
        entries: Any = found.value if found is not None else None
        return batches_ready(entries, tracker._local_public_key, int(self.optimizer.local_epoch))

    def meet(self, batch_size: int) -> bool:
        """Announce a batch of `batch_size` samples and wait, outside the step lock, until
        every other live trainer holds a batch for this epoch too, up to `pace.wait_s`.
        False if the trainer stops meanwhile: the batch's gradients are then thrown away
        before any round (its groups are not trained)."""
        self.announce(batch_size)
        wait_s = self.pace.wait_s
        deadline = time.monotonic() + wait_s
        while (others := self.other_trainers()) > 0:
            if self.optimizer.stopping.is_set():
                with self.optimizer.step_lock:
                    self.optimizer.zero_grad()
                    self.optimizer.discards += 1
                return False
            ready = self.ready()
            if ready >= others:
                break
            if time.monotonic() >= deadline:
                self.waits += 1
                log.info(
                    "%d of %d other trainers hold a batch after %.0f s; trying the round",
                    ready,
                    others,
                    wait_s,
                )
                break
            time.sleep(PEER_POLL_S)
        return True
