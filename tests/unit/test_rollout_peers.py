"""A rollout node's view of its peers (node/rollout_peers.py), built alone from hand-made
directory records: who is listed, who is gone, who is back, which coordinator."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import pytest

from agentjet import protocol
from agentjet.config import Config
from node import rollout_peers
from node.policy_sync import PolicySync
from node.rollout_peers import Peers

pytestmark = pytest.mark.unit

ENDPOINT = "tcp://127.0.0.1:41001"


class FakeSync:
    """What Peers tells a policy's sync: a trainer's version, a trainer gone."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.forgotten: list[str] = []

    def saw(self, version: int) -> None:
        self.seen.append(version)

    def forget(self, trainer_id: str) -> None:
        self.forgotten.append(trainer_id)


class FakeClient:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.closed = False

    def close(self) -> None:
        self.closed = True


def record(node_id: str, heartbeat: float, **fields: Any) -> protocol.NodeRecord:
    """A trainer's record (unless `fields` say otherwise) at ENDPOINT, heartbeat `heartbeat`."""
    fields = {"role": "trainer", "endpoint": ENDPOINT, **fields}
    return protocol.NodeRecord(node_id=node_id, time=heartbeat, **fields)


@pytest.fixture
def peers(monkeypatch: pytest.MonkeyPatch) -> tuple[Peers, FakeSync]:
    monkeypatch.setattr(rollout_peers, "trainer_client", lambda endpoint, *_: FakeClient(endpoint))
    sync = FakeSync()
    policies = cast(Mapping[str, PolicySync], {"": sync})
    hello = protocol.Hello(node_id="rollout-test", role="rollout")
    return Peers(Config(), hello, None, policies), sync


def test_a_gone_trainer_is_listed_again_only_on_a_newer_record(
    peers: tuple[Peers, FakeSync],
) -> None:
    view, sync = peers
    assert view.apply_trainers([record("t", 100.0, policy_version=4)], now=0.0) == []
    assert list(view.trainers) == ["t"] and sync.seen == [4]
    client = view.clients["t"]

    view.drop_trainer("t")
    assert "t" not in view.trainers and view.retired == [client]
    assert sync.forgotten == ["t"] and "t" in view.departed
    # Its last record, read again (it outlives the trainer, or a read lags): not back.
    view.apply_trainers([record("t", 100.0)], now=1.0)
    assert "t" not in view.trainers
    # A newer heartbeat: restarted, listed again.
    view.apply_trainers([record("t", 101.0)], now=2.0)
    assert "t" in view.trainers and "t" not in view.gone


def test_a_trainer_missing_from_two_reads_in_a_row_is_called_gone(
    peers: tuple[Peers, FakeSync],
) -> None:
    view, _ = peers
    heartbeat_s = view.config.swarm.heartbeat_s
    view.apply_trainers([record("t", 100.0)], now=0.0)
    assert view.apply_trainers([], now=1.0) == []  # missing from one read
    assert view.apply_trainers([], now=1.0 + heartbeat_s) == ["t"]
    view.apply_trainers([record("t", 100.0 + heartbeat_s)], now=2.0 + heartbeat_s)
    assert view.missing_since == {}  # listed again before it was dropped


def test_records_of_other_roles_policies_and_protocols_list_no_trainer(
    peers: tuple[Peers, FakeSync],
) -> None:
    view, _ = peers
    view.apply_trainers(
        [
            record("r", 100.0, role="rollout"),
            record("p", 100.0, policy="solver"),  # a policy this node does not hold
            record("old", 100.0, protocol_version=protocol.PROTOCOL_VERSION - 1),
            record("nowhere", 100.0, endpoint=""),
        ],
        now=0.0,
    )
    assert view.trainers == {}


def test_a_trainer_at_another_endpoint_gets_a_new_client_and_the_old_one_is_retired(
    peers: tuple[Peers, FakeSync],
) -> None:
    view, _ = peers
    view.apply_trainers([record("t", 100.0)], now=0.0)
    old = view.clients["t"]
    view.apply_trainers([record("t", 5.0, endpoint="tcp://127.0.0.1:41002")], now=1.0)
    assert view.trainers["t"].endpoint == "tcp://127.0.0.1:41002"
    assert view.retired == [old] and view.heartbeats["t"] == 5.0  # (another clock)


def test_a_static_trainer_is_unnamed_in_requests_and_a_listed_one_by_its_id(
    peers: tuple[Peers, FakeSync],
) -> None:
    view, _ = peers
    view.add_static_trainer("", ENDPOINT)
    view.add_static_trainer("solver", "tcp://127.0.0.1:41003")
    view.apply_trainers([record("t", 100.0, endpoint="tcp://127.0.0.1:41004")], now=0.0)
    names = {trainer_id: view.address(t) for trainer_id, t in view.trainers.items()}
    assert names == {"trainer": "", "trainer/solver": "", "t": "t"}
    assert view.trainers["trainer/solver"].policy == "solver"


def test_the_newest_coordinator_record_is_the_one_connected(
    peers: tuple[Peers, FakeSync],
) -> None:
    view, _ = peers
    records = [
        record("c1", 100.0, role="coordinator", endpoint="tcp://127.0.0.1:42001"),
        record("c2", 200.0, role="coordinator", endpoint="tcp://127.0.0.1:42002"),
    ]
    view.apply_coordinator(records)
    try:
        assert view.coordinator is not None
        assert view.coordinator.endpoint == "tcp://127.0.0.1:42002"
        first = view.coordinator
        view.apply_coordinator(records)  # the same endpoint: the same client
        assert view.coordinator is first and view.retired == []
    finally:
        view.close_clients()
