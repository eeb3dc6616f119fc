"""How trainers vouch for each other's groups: which peers' gradients a round's result
holds (node/allreduce.py), the batch ids their rounds carry, "trained" through a marked
batch (node/directory.py), and how a trainer settles a batch whose round failed on its side
only (node/trainer_doubtful.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from node.allreduce import RoundResult, complete_contributors, incomplete, uneven
from node.averagers import round_data, round_epochs, vouched_batches
from node.directory import MAX_BATCH_ID_CHARS, batches_named, is_batch_id, trained_through_batches
from node.groups import DoubtfulBatch, settle

pytestmark = pytest.mark.unit


def test_every_peer_that_sent_weight_is_a_contributor_when_nothing_failed() -> None:
    weights = {"a": 8.0, "b": 4.0}
    assert complete_contributors(weights, set(), some_reducer_failed=False) == {"a", "b"}


def test_a_peer_that_tagged_along_with_weight_zero_contributed_nothing() -> None:
    # hivemind joins a scheduled round with weight zero when it threw the gradients away
    assert complete_contributors({"a": 8.0, "b": 0.0}, set(), False) == {"a"}


def test_a_peer_that_stopped_sending_is_left_out() -> None:
    assert complete_contributors({"a": 8.0, "b": 4.0}, {"b"}, False) == {"a"}


def test_after_a_failed_reducer_no_other_peer_is_all_in() -> None:
    # This peer kept its own values for the failed reducer's parts.
    assert complete_contributors({"a": 8.0, "b": 4.0}, set(), True) == frozenset()


def test_in_a_partial_round_no_other_peer_is_all_in() -> None:
    # some reducer left a sender out midway: its parts' total weights differ
    assert complete_contributors({"a": 8.0, "b": 4.0}, set(), False, partial=True) == set()


@pytest.mark.parametrize(
    ("part_weights", "partial"),
    [
        ([], False),
        ([12.0, 12.0, 12.0], False),
        ([12.0, 12.0, 8.0], True),  # a sender of weight 4 stopped before the last part
        ([0.1 + 0.2, 0.3], False),  # the same weights summed in another order
    ],
)
def test_an_average_is_partial_when_its_parts_total_different_weights(
    part_weights: list[float], partial: bool
) -> None:
    assert uneven(part_weights) is partial


def test_a_round_vouches_for_the_batches_of_its_contributors_only() -> None:
    result = RoundResult(
        {"me": ["m/3", 5], "a": ["a/1", 5], "b": ["b/7", 5], "c": None, "d": [12, 5]},
        missing=0.0,
        contributors=frozenset({"a", "c", "d"}),
    )
    # b tagged along (not a contributor); c and d sent no batch id (a stock or odd peer)
    assert vouched_batches(result) == ("a/1",)
    assert not incomplete(result)
    assert incomplete(RoundResult({}, missing=0.25, contributors=frozenset()))


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        (["a/1", 7], ("a/1", 7)),
        (("a/1", 0), ("a/1", 0)),
        (["a/1", True], ("a/1", None)),  # a bool is no epoch
        (["a/1", "7"], ("a/1", None)),
        ([b"a/1", 7], (None, 7)),
        (["a/1"], (None, None)),
        ("a/1", (None, None)),
        (None, (None, None)),
    ],
)
def test_what_a_peer_sends_with_its_gradient_round(value: object, parsed: tuple) -> None:
    assert round_data(value) == parsed


def test_a_round_says_which_epochs_its_peers_were_at() -> None:
    # a trainer one version behind, whose tracker had not seen the swarm move on
    result = RoundResult({"me": ["m/3", 5], "a": ["a/1", 6]}, 0.0, frozenset({"a"}))
    assert round_epochs(result) == {5, 6}
    assert round_epochs(RoundResult({"me": ["m/3", 5], "x": "junk"}, 0.0, frozenset())) == {
        5,
        None,
    }


@pytest.mark.parametrize(
    "value", [None, "", 7, b"a/1", ["a/1"], {"a": 1}, "x" * (MAX_BATCH_ID_CHARS + 1)]
)
def test_what_a_peer_sends_as_a_batch_id_must_be_a_short_string(value: object) -> None:
    assert not is_batch_id(value)


def test_the_batches_of_an_intent_read_from_the_dht() -> None:
    assert batches_named(None) == set()  # no intent stored
    assert batches_named(SimpleNamespace(value=b"junk")) == set()  # not a dictionary
    found = SimpleNamespace(value={"a/1": 1, "a/2": 1, 5: 1, "": 1})
    assert batches_named(found) == {"a/1", "a/2"}


def test_a_group_is_trained_when_any_batch_that_held_it_is_marked() -> None:
    # g2 was in trainer b's batch b/1, then (b gone, b/1 unmarked) in trainer c's c/4
    intents = {"g1": {"b/1"}, "g2": {"b/1", "c/4"}, "g3": {"c/4"}, "g4": set()}
    assert trained_through_batches(intents, marked={"b/1"}) == {"g1", "g2"}
    assert trained_through_batches(intents, marked={"c/4"}) == {"g2", "g3"}
    assert trained_through_batches(intents, marked=set()) == set()


def doubtful(batch_id: str, epoch: int = 5, deadline: float = 100.0) -> DoubtfulBatch:
    return DoubtfulBatch(batch_id, epoch, groups=[], deadline=deadline)


def test_a_marked_batch_is_trained_once_the_trainer_holds_a_later_version() -> None:
    batch = doubtful("b/1", epoch=5)
    # the peer stepped 5 -> 6 with it; this trainer is still at 5: catch up first
    assert settle([batch], {"b/1"}, version=5, other_versions=[6], now=0.0) == ([], [], [batch])
    assert settle([batch], {"b/1"}, version=6, other_versions=[6], now=0.0) == ([batch], [], [])


def test_an_unmarked_batch_waits_while_a_peer_may_still_be_in_its_step() -> None:
    batch = doubtful("b/1", epoch=5)
    # a trainer at version 5 may be stepping with it now: its marks come before its record
    # shows version 6
    assert settle([batch], set(), version=5, other_versions=[6, 5], now=0.0) == ([], [], [batch])


def test_an_unmarked_batch_is_trained_again_once_every_peer_moved_past_its_round() -> None:
    batch = doubtful("b/1", epoch=5)
    assert settle([batch], set(), version=5, other_versions=[6, 7], now=0.0) == ([], [batch], [])
    # no other trainer is left to have taken it
    assert settle([batch], set(), version=5, other_versions=[], now=0.0) == ([], [batch], [])


def test_at_its_deadline_a_batch_not_settled_is_trained_again() -> None:
    waiting = doubtful("b/1", epoch=5, deadline=10.0)
    marked_but_out_of_reach = doubtful("b/2", epoch=5, deadline=10.0)
    trained, again, still = settle(
        [waiting, marked_but_out_of_reach], {"b/2"}, version=5, other_versions=[5], now=10.0
    )
    assert (trained, again, still) == ([], [waiting, marked_but_out_of_reach], [])


def test_hivemind_errors_of_expected_swarm_conditions_become_one_warning_line():
    import logging

    from node.dht import ExpectedSwarmErrors

    try:
        raise RuntimeError("dial to self attempted")
    except RuntimeError:
        import sys

        exc_info = sys.exc_info()
    record = logging.LogRecord(
        "hivemind.averaging.averager", logging.ERROR, "x", 1, "Failed to download state from %s",
        ("QmPeer",), exc_info,
    )  # fmt: skip
    assert ExpectedSwarmErrors().filter(record)
    assert record.levelname == "WARNING" and record.exc_info is None
    assert record.getMessage().startswith("Failed to download state from QmPeer")
    ours = logging.LogRecord("node.trainer", logging.ERROR, "x", 1, "dial to self", (), None)
    assert ExpectedSwarmErrors().filter(ours) and ours.levelname == "ERROR"
