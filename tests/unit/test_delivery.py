"""A rollout node's ledger of groups: where each group is until a trainer trained it."""

from __future__ import annotations

import random

import msgspec
import pytest

from agentjet import protocol
from node.delivery import Ledger, TrainerPeer
from tests.factories import make_group

pytestmark = pytest.mark.unit


def ack(group_id: str, status: str) -> protocol.GroupAck:
    return protocol.GroupAck(group_id=group_id, status=status, policy_version=0)  # type: ignore[arg-type]


def ledger_with(*group_ids: str) -> Ledger:
    ledger = Ledger(rng=random.Random(0))
    for g in group_ids:
        ledger.add(make_group(g))
    return ledger


def test_an_accepted_group_is_held_until_the_trainer_says_trained() -> None:
    ledger = ledger_with("g")
    a = TrainerPeer("a", "tcp://h:1")
    [pending] = ledger.to_offer()
    assert ledger.pick(pending, {"a": a}, now=0.0) is a
    assert ledger.offered(pending, a, ack("g", "accepted"), now=0.0) == "accepted"
    assert ledger.to_offer() == [] and len(ledger) == 1 and ledger.unplaced() == 0
    assert ledger.statuses("a", {"g": "queued"}) == {"trained": 0, "dropped": 0, "resent": 0}
    assert len(ledger) == 1
    assert ledger.statuses("a", {"g": "trained"})["trained"] == 1
    assert len(ledger) == 0


def test_a_restarted_trainer_that_forgot_a_group_gets_it_again() -> None:
    ledger = ledger_with("g")
    a = TrainerPeer("a", "tcp://h:1")
    ledger.offered(ledger.to_offer()[0], a, ack("g", "accepted"), now=0.0)
    assert ledger.statuses("a", {"g": "unknown"})["resent"] == 1
    assert [p.group.group_id for p in ledger.to_offer()] == ["g"]


def test_stale_and_rejected_groups_are_final() -> None:
    ledger = ledger_with("s", "r")
    a = TrainerPeer("a", "tcp://h:1")
    for pending, status in zip(ledger.to_offer(), ("stale", "rejected"), strict=True):
        assert ledger.offered(pending, a, ack(pending.group.group_id, status), now=0.0) == status
    assert len(ledger) == 0


def test_a_busy_trainer_is_left_alone_and_another_takes_the_group() -> None:
    ledger = ledger_with("g")
    a, b = TrainerPeer("a", "tcp://h:1"), TrainerPeer("b", "tcp://h:2", queue=3, capacity=4)
    trainers = {"a": a, "b": b}
    [pending] = ledger.to_offer()
    assert ledger.pick(pending, trainers, now=0.0) is a  # the least backlogged
    busy = protocol.Error(code="busy", message="full")
    assert ledger.offered(pending, a, busy, now=0.0) == "busy"
    assert ledger.pick(pending, trainers, now=0.1) is b
    assert ledger.pick(pending, trainers, now=10.0) is a  # a's pause is over


def test_a_group_answered_by_a_trainer_restarted_on_its_endpoint_waits_for_the_first() -> None:
    """Its offer went unanswered, the trainer died and another came up on its endpoint: the
    dead one may have queued the group (and a mark may say it trained it), so it is settled
    as the dead trainer's, never offered to another meanwhile (the fault suite trained two
    such groups twice: the restarted trainer took them, and they were sent on as well)."""
    ledger = ledger_with("g")
    a, b = TrainerPeer("a", "tcp://h:1"), TrainerPeer("b", "tcp://h:2")
    [g] = ledger.to_offer()
    ledger.unanswered(g, a, now=0.0)
    gone = protocol.Error(code="gone", message="this is a2, not a")
    assert ledger.offered(g, a, gone, now=5.0) == "gone"
    assert ledger.pick(g, {"a": a, "b": b}, now=5.1) is None  # not to b, not yet
    assert ledger.trainer_gone("a", trained=set()) == {"trained": 0, "resent": 1, "waiting": 0}
    assert ledger.pick(g, {"b": b}, now=5.2) is b


def test_an_unanswered_group_goes_only_to_the_same_trainer_until_it_is_gone() -> None:
    """No reply does not mean not received: offering it elsewhere could train it twice."""
    ledger = ledger_with("g", "h")
    a, b = TrainerPeer("a", "tcp://h:1"), TrainerPeer("b", "tcp://h:2")
    g, h = ledger.to_offer()
    ledger.unanswered(g, a, now=0.0)
    ledger.offered(h, a, ack("h", "accepted"), now=0.0)
    assert ledger.pick(g, {"a": a, "b": b}, now=0.1) is None  # a is backing off, b is not asked
    assert ledger.pick(g, {"a": a, "b": b}, now=5.0) is a
    # a dies: what the DHT marks trained is done, the rest goes to b
    assert ledger.trainer_gone("a", trained={"h"}) == {"trained": 1, "resent": 1, "waiting": 0}
    assert [p.group.group_id for p in ledger.to_offer()] == ["g"]
    assert ledger.pick(g, {"b": b}, now=5.0) is b


def test_a_group_whose_mark_cannot_be_read_yet_stays_with_the_gone_trainer() -> None:
    """Both trainers killed at once: the mark's step is in no listed trainer yet, but a
    trainer of its lineage is listed behind it (a dead one's record, or one catching up)."""
    ledger = ledger_with("g", "h")
    a = TrainerPeer("a", "tcp://h:1")
    for pending in ledger.to_offer():
        ledger.offered(pending, a, ack(pending.group.group_id, "accepted"), now=0.0)
    assert ledger.trainer_gone("a", trained=set(), waiting={"g"}) == {
        "trained": 0,
        "resent": 1,
        "waiting": 1,
    }
    assert [p.group.group_id for p in ledger.to_offer()] == ["h"]
    assert [p.group.group_id for p in ledger.held_by("a")] == ["g"]  # read again later
    assert ledger.trainer_gone("a", trained={"g"}) == {"trained": 1, "resent": 0, "waiting": 0}


def test_backpressure_counts_only_groups_no_trainer_holds() -> None:
    ledger = ledger_with("g1", "g2", "g3")
    a = TrainerPeer("a", "tcp://h:1")
    ledger.offered(ledger.to_offer()[0], a, ack("g1", "accepted"), now=0.0)
    assert ledger.unplaced() == 2 and len(ledger) == 3


def test_a_group_goes_only_to_a_trainer_of_its_policy() -> None:
    ledger = Ledger(rng=random.Random(0))
    ledger.add(msgspec.structs.replace(make_group("p"), policy="planner"))
    ledger.add(make_group("one"))  # the swarm's one policy ("")
    planner = TrainerPeer("a", "tcp://h:1", policy="planner")
    solver = TrainerPeer("b", "tcp://h:2", policy="solver", queue=0, capacity=100)
    trainers = {"a": planner, "b": solver}
    by_id = {p.group.group_id: p for p in ledger.to_offer()}
    for _ in range(20):  # however the backlogs compare
        assert ledger.pick(by_id["p"], trainers, now=0.0) is planner
    assert ledger.pick(by_id["one"], trainers, now=0.0) is None  # no trainer of "": it waits
    assert ledger.pick(by_id["p"], {"b": solver}, now=0.0) is None
    # backpressure counts each policy's waiting groups apart
    assert (ledger.unplaced("planner"), ledger.unplaced(""), ledger.unplaced()) == (1, 1, 2)
    ledger.offered(by_id["p"], planner, ack("p", "accepted"), now=0.0)
    assert (ledger.unplaced("planner"), ledger.unplaced()) == (0, 1)
