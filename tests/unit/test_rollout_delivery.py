"""Delivery to trainers and backpressure (node/rollout_delivery.py), alone over a Ledger and
a view of fake trainers: an accepted group is held, a trainer found gone mid-offer keeps
the group it may hold, and only policies below the bound get more work."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import pytest

from agentjet import protocol
from agentjet.config import Config
from agentjet.transport import PeerUnavailable
from node import rollout_peers
from node.delivery import Ledger, TrainerPeer
from node.policy_sync import PolicySync
from node.rollout_delivery import Backpressure, Delivery
from node.rollout_peers import Peers
from node.spool import Spool
from tests.factories import make_group

pytestmark = pytest.mark.unit


class FakeSync:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def saw(self, version: int) -> None:
        self.seen.append(version)

    def forget(self, trainer_id: str) -> None:
        pass


class FakeTrainer:
    """Answers SubmitGroup with `reply` (an exception: raised); `meanwhile` runs while the
    request is in flight."""

    def __init__(self, reply: Any) -> None:
        self.reply = reply
        self.meanwhile: Callable[[], None] = lambda: None
        self.asked: list[Any] = []

    async def request(self, msg: Any, timeout_s: float | None = None) -> Any:
        self.asked.append(msg)
        self.meanwhile()
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply

    def close(self) -> None:
        pass


def delivery_to(trainer: FakeTrainer, monkeypatch: pytest.MonkeyPatch) -> tuple[Delivery, FakeSync]:
    monkeypatch.setattr(rollout_peers, "trainer_client", lambda *_: trainer)
    sync = FakeSync()
    hello = protocol.Hello(node_id="rollout-test", role="rollout")
    peers = Peers(Config(), hello, None, cast(Mapping[str, PolicySync], {"": sync}))
    peers.add_trainer(TrainerPeer("t", "tcp://127.0.0.1:41001"))
    ledger = Ledger(rng=random.Random(0))
    ledger.add(make_group("g"))
    delivery = Delivery(ledger, peers, Backpressure(ledger, [""], 4), defaultdict(int))
    return delivery, sync


def offer_once(delivery: Delivery) -> None:
    [pending] = delivery.ledger.to_offer()
    asyncio.run(delivery.offer(pending, delivery.peers.trainers["t"]))


def test_an_accepted_group_is_held_and_the_trainers_version_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ack = protocol.GroupAck(group_id="g", status="accepted", policy_version=6)
    trainer = FakeTrainer(ack)
    delivery, sync = delivery_to(trainer, monkeypatch)
    offer_once(delivery)
    [submit] = trainer.asked
    assert submit.trainer_id == "t"  # a listed trainer is asked by its id
    assert delivery.ledger.pending["g"].state == "held"
    assert delivery.counts["groups_accepted"] == 1 and sync.seen == [6]


def test_a_trainer_found_gone_mid_offer_keeps_the_group_it_may_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer = FakeTrainer(PeerUnavailable("no reply"))
    delivery, _ = delivery_to(trainer, monkeypatch)

    def found_gone_and_settled() -> None:  # (its other groups: none)
        delivery.peers.drop_trainer("t")
        del delivery.peers.departed["t"]

    trainer.meanwhile = found_gone_and_settled
    offer_once(delivery)
    pending = delivery.ledger.pending["g"]
    assert (pending.state, pending.trainer) == ("unsure", "t")
    assert "t" in delivery.peers.departed  # to be settled like the groups it held


def test_only_policies_below_the_bound_have_room_and_a_full_spool_stops_all(
    tmp_path: Path,
) -> None:
    ledger = Ledger(rng=random.Random(0))
    backpressure = Backpressure(ledger, ["solver", "coder"], max_unacked_groups=2)
    for i in range(2):
        group = make_group(f"s{i}")
        group.policy = "solver"
        ledger.add(group)
    assert backpressure.with_room() == ["coder"] and backpressure.has_room()
    backpressure.close_if_full()
    assert backpressure.room.is_set()

    ledger.spool = Spool(tmp_path, max_bytes=1)
    ledger.spool.nbytes = 1  # (at its cap)
    assert backpressure.with_room() == []
    backpressure.close_if_full()
    assert not backpressure.room.is_set()
    ledger.spool.nbytes = 0
    backpressure.open_if_room()
    assert backpressure.room.is_set()
    ledger.spool.close()
