"""The groups of a trainer found gone (node/rollout_gone.py), alone over a Ledger, a view of
peers and a fake directory: those its live peers' marks say trained are done, the others go
to live trainers, and nothing is told while no trainer of its policy answers."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import pytest

from agentjet import protocol
from agentjet.config import Config
from agentjet.metrics import MetricsWriter, read_metrics
from node import rollout_peers
from node.delivery import Ledger, TrainerPeer
from node.directory import Directory
from node.rollout_gone import GoneTrainers, through_batches
from node.rollout_peers import Peers
from tests.factories import make_group

pytestmark = pytest.mark.unit

LIVE = [(protocol.Lineage(), 3)]


class FakeDirectory:
    """g1 marked trained by its trainer's own step, g2 through a peer's batch."""

    def __init__(self) -> None:
        self.asked: list[list[tuple[protocol.Lineage, int]]] = []

    def trained(
        self, group_ids: Iterable[str], live: list[tuple[protocol.Lineage, int]]
    ) -> dict[str, str | None]:
        self.asked.append(live)
        marks = {"g1": None, "g2": "batch-7"}
        return {g: marks[g] for g in group_ids if g in marks}

    def undecided(
        self, group_ids: Iterable[str], live: list[tuple[protocol.Lineage, int]]
    ) -> set[str]:
        return set()


def settle(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    answering: dict[str, list[tuple[protocol.Lineage, int]]],
) -> tuple[GoneTrainers, FakeDirectory]:
    """Trainer "dead" held g1, g2, g3 and is found gone; "live" is listed."""
    monkeypatch.setattr(rollout_peers, "trainer_client", lambda *_: None)
    hello = protocol.Hello(node_id="rollout-test", role="rollout")
    peers = Peers(Config(), hello, None, {})
    for trainer_id in ("dead", "live"):
        peers.add_trainer(TrainerPeer(trainer_id, f"tcp://{trainer_id}:1"))

    async def answers_now() -> dict[str, list[tuple[protocol.Lineage, int]]]:
        return answering

    monkeypatch.setattr(peers, "answering", answers_now)
    ledger = Ledger(rng=random.Random(0))
    for group_id in ("g1", "g2", "g3"):
        ledger.add(make_group(group_id), holder="dead")
    peers.drop_trainer("dead")
    directory = FakeDirectory()
    metrics = MetricsWriter(tmp_path, "rollout")
    unsent = asyncio.Event()
    gone = GoneTrainers(
        peers, ledger, cast(Directory, directory), 60.0, metrics, defaultdict(int), unsent
    )
    asyncio.run(gone.settle())
    metrics.close()
    return gone, directory


def test_a_gone_trainers_groups_are_trained_per_the_marks_or_sent_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone, directory = settle(tmp_path, monkeypatch, {"": list(LIVE)})
    assert directory.asked == [LIVE]  # read against what the live trainers answer
    assert list(gone.ledger.pending) == ["g3"]
    assert gone.ledger.pending["g3"].state == "new"  # offered to the live trainers
    assert gone.peers.departed == {} and gone.unsent.is_set()
    assert gone.counts == {"groups_trained": 2, "groups_resent_elsewhere": 1}
    [row] = read_metrics(tmp_path / "metrics" / "rollout.jsonl")
    assert row["event"] == "trainer_gone" and row["node_id"] == "dead"
    assert row["trained_group_ids"] == ["g1", "g2"]
    assert row["trained_through_batches"] == {"g2": "batch-7"}
    assert (row["resent"], row["waiting"]) == (1, 0)


def test_nothing_is_told_while_no_trainer_of_its_policy_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone, directory = settle(tmp_path, monkeypatch, {"solver": list(LIVE)})
    assert directory.asked == [] and "dead" in gone.peers.departed
    assert all(p.trainer == "dead" for p in gone.ledger.pending.values())
    assert not gone.unsent.is_set()


def test_only_groups_trained_through_a_peers_batch_name_it() -> None:
    assert through_batches({"b": "batch-1", "a": None, "c": "batch-2"}) == {
        "b": "batch-1",
        "c": "batch-2",
    }
