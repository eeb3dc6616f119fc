"""Values nodes store in the DHT, signed by their writer and checked when read
(node/signed_values.py): a value counts only under the key it was signed for, and a node
record only under the name of the node that signed it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agentjet.identity import NodeKeys
from agentjet.keys import new_keys
from node.signed_values import read_value, sign_record, sign_value, verified_record

pytestmark = pytest.mark.unit


@pytest.fixture
def swarm() -> tuple[NodeKeys, NodeKeys]:
    """A writer and a reader of one swarm (one root)."""
    root = new_keys()
    return NodeKeys.from_root(root, "trainer-a"), NodeKeys.from_root(root, "rollout-r")


def test_without_keys_values_are_stored_and_read_bare() -> None:
    assert sign_record(None, b"record") == b"record"
    assert sign_value(None, "k", ["L1", 3]) == ["L1", 3]
    assert read_value(None, "k", SimpleNamespace(value=["L1", 3])) == ["L1", 3]
    assert read_value(None, "k", ["L1", 3]) == ["L1", 3]
    assert read_value(None, "k", None) is None


def test_a_signed_value_reads_back_under_its_own_key_only(
    swarm: tuple[NodeKeys, NodeKeys],
) -> None:
    writer, reader = swarm
    stored = sign_value(writer, "run.trained.g1", ["L1", 3])
    assert stored != ["L1", 3]
    assert read_value(reader, "run.trained.g1", SimpleNamespace(value=stored)) == ["L1", 3]
    assert read_value(reader, "run.trained.g1", stored) == ["L1", 3]
    assert reader.membership.refused == {}
    # replayed under another group's key: forged
    assert read_value(reader, "run.trained.g2", stored) is None
    assert reader.membership.refused == {"forged": 1}
    # absent: nothing to refuse
    assert read_value(reader, "run.trained.g1", SimpleNamespace(value=None)) is None
    assert reader.membership.refused == {"forged": 1}


def test_unsigned_or_strangers_values_are_refused(swarm: tuple[NodeKeys, NodeKeys]) -> None:
    _, reader = swarm
    stranger = NodeKeys.from_root(new_keys(), "trainer-a")
    assert read_value(reader, "k", ["L1", 3]) is None  # a bare value in a keyed swarm
    assert read_value(reader, "k", sign_value(stranger, "k", ["L1", 3])) is None
    assert sum(reader.membership.refused.values()) == 2


def test_a_record_counts_only_under_the_name_of_the_node_that_signed_it(
    swarm: tuple[NodeKeys, NodeKeys],
) -> None:
    writer, reader = swarm
    record = sign_record(writer, b"payload")
    membership = reader.membership
    assert verified_record(membership, "trainer-a", record) == b"payload"
    # a trainer serving several policies signs NODE/POLICY as NODE
    assert verified_record(membership, "trainer-a/math", record) == b"payload"
    assert membership.refused == {}
    assert verified_record(membership, "trainer-b", record) is None
    assert membership.refused == {"impersonation": 1}
    assert verified_record(membership, "trainer-a", b"payload") is None  # unsigned
    assert membership.refused == {"impersonation": 1, "forged": 1}
