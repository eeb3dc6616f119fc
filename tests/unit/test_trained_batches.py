"""How trainers vouch for each other's groups: batch ids of gradient rounds, which peers'
gradients a round's result holds, and "trained" through a marked batch (node/swarm.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from node.swarm import (
    MAX_BATCH_ID_CHARS,
    RoundBatch,
    batches_named,
    complete_contributions,
    is_batch_id,
    trained_through_batches,
)

pytestmark = pytest.mark.unit


def test_each_round_gets_a_new_batch_id_and_a_restarted_trainer_new_ones() -> None:
    first = RoundBatch("p1")
    ids = [first.next_round(epoch=3), first.next_round(epoch=3), first.next_round(epoch=4)]
    assert ids == ["p1/3/1", "p1/3/2", "p1/4/3"]
    assert first.batch_id == "p1/4/3"
    # the same trainer after a restart (same epoch, counter from zero), another prefix
    assert RoundBatch("p2").next_round(epoch=3) not in ids
    assert all(is_batch_id(b) for b in ids)


def test_a_batch_holds_the_groups_added_until_its_gradients_are_stepped_or_dropped() -> None:
    batch = RoundBatch("p")
    batch.add(["g1", "g2"])
    batch.next_round(epoch=0)
    batch.add(["g3"])  # accumulated before the round is triggered: in the same batch
    assert batch.group_ids == ["g1", "g2", "g3"]
    batch.clear()
    assert batch.group_ids == [] and batch.batch_id is None


def test_a_round_vouches_for_every_peer_when_nothing_failed() -> None:
    gathered = {"me": "m/1/1", "a": "a/1/1", "b": "b/1/1"}
    assert complete_contributions(gathered, "me", set(), some_reducer_failed=False) == gathered


def test_a_peer_that_stopped_sending_is_left_out() -> None:
    gathered = {"me": "m/1/1", "a": "a/1/1", "b": "b/1/1"}
    got = complete_contributions(gathered, "me", {"b"}, some_reducer_failed=False)
    assert got == {"me": "m/1/1", "a": "a/1/1"}


def test_after_a_failed_reducer_a_round_vouches_only_for_this_peer() -> None:
    # This peer kept its own values for the failed reducer's part: no peer's gradients
    # are all in its result.
    gathered = {"me": "m/1/1", "a": "a/1/1"}
    assert complete_contributions(gathered, "me", set(), some_reducer_failed=True) == {
        "me": "m/1/1"
    }


@pytest.mark.parametrize(
    "value", [None, "", 7, b"a/1/1", ["a/1/1"], {"a": 1}, "x" * (MAX_BATCH_ID_CHARS + 1)]
)
def test_what_a_peer_sends_as_a_batch_id_must_be_a_short_string(value: object) -> None:
    assert not is_batch_id(value)


def test_the_batches_of_an_intent_read_from_the_dht() -> None:
    assert batches_named(None) == set()  # no intent stored
    assert batches_named(SimpleNamespace(value=b"junk")) == set()  # not a dictionary
    found = SimpleNamespace(value={"a/1/1": 1, "a/2/2": 1, 5: 1, "": 1})
    assert batches_named(found) == {"a/1/1", "a/2/2"}


def test_a_group_is_trained_when_any_batch_that_carried_it_is_marked() -> None:
    intents = {"g1": {"b/1/1"}, "g2": {"b/1/1", "b/2/2"}, "g3": {"b/2/2"}, "g4": set()}
    assert trained_through_batches(intents, marked={"b/1/1"}) == {"g1", "g2"}
    assert trained_through_batches(intents, marked={"b/2/2"}) == {"g2", "g3"}
    assert trained_through_batches(intents, marked=set()) == set()
