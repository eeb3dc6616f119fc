"""How trainers vouch for each other's groups: which peers' gradients a round's result
holds (node/allreduce.py), the batch ids their rounds carry, and "trained" through a
marked batch (node/swarm.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from node.allreduce import RoundResult, complete_contributors, incomplete
from node.swarm import (
    MAX_BATCH_ID_CHARS,
    batches_named,
    is_batch_id,
    round_data,
    round_epochs,
    trained_through_batches,
    vouched_batches,
)

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
