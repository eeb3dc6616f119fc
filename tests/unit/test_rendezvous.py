"""A trainer's wait for its peers' batches before a gradient round (node/rendezvous.py),
over a stand-in optimizer and DHT: what counts as a peer's batch, when the wait ends, and
a stop that gives the batch up."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import hivemind
import pytest

from node.optimizer import HivemindOptimizer
from node.rendezvous import Rendezvous, batches_ready

pytestmark = pytest.mark.unit

OWN = b"own-key"
PROGRESS_KEY = "run_progress"


def progress(epoch: int, samples: object = 4, client_mode: object = False) -> Any:
    """One trainer's progress record as the DHT returns it (a value with an expiration)."""
    return SimpleNamespace(
        value={"epoch": epoch, "samples_accumulated": samples, "client_mode": client_mode}
    )


def test_only_other_trainers_holding_a_batch_for_this_epoch_count() -> None:
    entries = {
        OWN: progress(3),  # this trainer's own record
        b"a": progress(3),  # ready
        b"b": progress(2),  # a batch for an older epoch
        b"c": progress(3, samples=0),  # no batch yet
        b"d": progress(3, client_mode=True),  # a client: never in a round
        b"e": progress(3, samples="4"),  # malformed, stored by a stranger
        b"f": SimpleNamespace(value=["not", "a", "dict"]),
        b"g": "no value at all",
        b"h": progress(3, samples=1),  # ready
    }
    assert batches_ready(entries, OWN, epoch=3) == 2
    assert batches_ready(entries, OWN, epoch=2) == 1
    assert batches_ready(None, OWN, epoch=3) == 0
    assert batches_ready(["junk"], OWN, epoch=3) == 0


@dataclass
class FakeTracker:
    training_progress_key: str = PROGRESS_KEY
    _local_public_key: bytes = OWN
    reported: list[tuple[int, int]] = field(default_factory=list)

    def report_local_progress(self, epoch: int, samples: int) -> None:
        self.reported.append((epoch, samples))


@dataclass
class FakeOptimizer:
    """What `Rendezvous` uses of `HivemindOptimizer`."""

    local_epoch: int = 3
    discards: int = 0
    zeroed: int = 0
    published: int = 0
    tracker: FakeTracker = field(default_factory=FakeTracker)
    grad_averager: Any = field(default_factory=lambda: SimpleNamespace(local_samples_accumulated=5))
    step_lock: Any = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)

    def zero_grad(self) -> None:
        self.zeroed += 1

    def _publish_progress(self) -> None:
        self.published += 1


class FakeDHT:
    """The progress records each read returns, in turn (the last one again after)."""

    def __init__(self, *reads: dict[bytes, Any]) -> None:
        self.reads = list(reads)
        self.asked = 0

    def get(self, key: str, latest: bool = False) -> Any:
        assert key == PROGRESS_KEY and latest
        self.asked += 1
        entries = self.reads[min(self.asked, len(self.reads)) - 1]
        return SimpleNamespace(value=entries)


def rendezvous(
    dht: FakeDHT, others: int = 1, floor_s: float = 60.0
) -> tuple[Rendezvous, FakeOptimizer]:
    optimizer = FakeOptimizer()
    meeting = Rendezvous(
        cast(HivemindOptimizer, optimizer), cast(hivemind.DHT, dht), lambda: others, floor_s
    )
    return meeting, optimizer


def test_announcing_a_batch_reports_the_samples_it_will_hold() -> None:
    meeting, optimizer = rendezvous(FakeDHT({}))
    meeting.announce(batch_size=2)
    assert optimizer.tracker.reported == [(3, 7)]  # 5 accumulated + 2 about to be
    assert optimizer.published == 1


def test_the_wait_ends_once_every_other_trainer_holds_a_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("node.rendezvous.PEER_POLL_S", 0.0)
    dht = FakeDHT(
        {OWN: progress(3), b"a": progress(3)},  # 1 of 2 other trainers ready: poll again
        {OWN: progress(3), b"a": progress(3), b"b": progress(3)},
    )
    meeting, optimizer = rendezvous(dht, others=2)
    assert meeting.meet(batch_size=1)
    assert dht.asked == 2 and meeting.waits == 0
    assert optimizer.tracker.reported == [(3, 6)] and optimizer.discards == 0


def test_a_wait_past_its_time_counts_and_goes_on_to_the_round() -> None:
    dht = FakeDHT({OWN: progress(3), b"a": progress(3)})  # 1 of 2 other trainers ready
    meeting, optimizer = rendezvous(dht, others=2, floor_s=0.0)
    assert meeting.meet(batch_size=1)
    assert meeting.waits == 1 and optimizer.discards == 0 and optimizer.zeroed == 0


def test_a_lone_trainer_does_not_wait() -> None:
    dht = FakeDHT({})
    meeting, _ = rendezvous(dht, others=0)
    assert meeting.meet(batch_size=1)
    assert dht.asked == 0


def test_a_stop_while_waiting_gives_the_batch_up() -> None:
    dht = FakeDHT({})
    meeting, optimizer = rendezvous(dht, others=1)
    optimizer.stopping.set()
    assert not meeting.meet(batch_size=1)
    assert optimizer.zeroed == 1 and optimizer.discards == 1
    assert meeting.waits == 0
